//! `rumble`: train a LLaMA-family model, show a step's memory plan, or time steps.
//!
//! `rumble train` with no arguments trains the `tiny` preset on the corpus shipped in
//! `data/corpus.txt` (byte-level tokens), on the GPU when one is usable and otherwise the CPU.

mod bench;
mod common;
mod plan;
mod suite;
mod train;

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
    Train(train::TrainArgs),
    /// Build a training step and show its trace and memory plan.
    Plan(plan::PlanArgs),
    /// Time training steps of a workload on random tokens.
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(a) => train::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
