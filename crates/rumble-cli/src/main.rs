//! `rumble`: train a LLaMA-family model, show a step's memory plan, time steps, or generate text.
//!
//! `rumble train` with no arguments trains the `tiny` preset on the corpus shipped in
//! `data/corpus.txt` (byte-level tokens), on the GPU when one is usable and otherwise the CPU.
//!
//! Errors end the command with status 1 and one `error: ...` line naming the culprit (file,
//! key, tensor, option); no input makes it panic. A closed stdout ends it quietly with status 0.

mod bench;
mod common;
mod generate;
mod generate_profile;
mod launch;
mod output;
mod plan;
mod rundir;
mod suite;
mod train;
mod train_data;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rumble", version, about = "A deep-learning compiler and runtime for training LLaMA-family models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (default: the tiny preset on the shipped corpus) and save a checkpoint.
    Train(Box<train::TrainArgs>),
    /// Build a training step and show its trace and memory plan.
    Plan(plan::PlanArgs),
    /// Time training steps of a workload on random tokens.
    Bench(bench::BenchArgs),
    /// Generate text from a model folder (KV cache; decode steps replayed as CUDA graphs).
    Generate(generate::GenerateArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(a) => train::run(*a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Generate(a) => generate::run(a),
    };
    match result {
        Ok(()) => {}
        // The reader of stdout closed it (`| head -1`): it wanted no more; a quiet success.
        Err(e) if output::is_broken_pipe(&e) => {}
        Err(e) => {
            note!("error: {e}");
            std::process::exit(1);
        }
    }
}
