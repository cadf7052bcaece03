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
use rumble_models::exec::DeviceChoice;

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
    // On the CPU only: a GPU run's host buffers (weights read before they go to the device)
    // are better handed back. `auto` counts the devices without making a context on one (a
    // context here would hold device memory for the whole run, a launcher's too).
    let on_cpu = |d: &str| match d.parse::<DeviceChoice>() {
        Ok(DeviceChoice::Cpu) => true,
        Ok(DeviceChoice::Auto) => rumble_cuda::Device::count().map_or(true, |n| n == 0),
        _ => false,
    };
    let device = match &cli.command {
        Command::Train(a) => Some(&a.device),
        Command::Bench(a) => Some(&a.device),
        Command::Generate(a) => Some(&a.device),
        Command::Plan(_) => None,
    };
    if device.is_some_and(|d| on_cpu(d)) {
        keep_host_memory();
    }
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

/// Has glibc's allocator keep freed host memory for the next allocation instead of handing it
/// back to the kernel (called for runs on the CPU). The CPU reference makes each value afresh,
/// and a real vocabulary's are 100 MB and more; glibc maps every allocation past its mmap
/// threshold from fresh pages and unmaps it when freed, so the kernel zeroes them again for the
/// next: page faults took 27 of 34 s of two CPU training steps of a 1-layer SmolLM2 shape (49k
/// vocabulary, batch 1 x 32); with this its steps take 2.5 s once the heap has grown, against
/// 14.5. Elsewhere (another C library) nothing changes.
fn keep_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets the allocator's parameters, which apply to later allocations;
    // it may be called at any time and invalidates no allocation made before.
    unsafe {
        const KEEP: libc::c_int = 1 << 30;
        libc::mallopt(libc::M_MMAP_THRESHOLD, KEEP);
        libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
