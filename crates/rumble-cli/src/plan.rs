//! `rumble plan`: builds a training step, runs the trainer's passes, and prints what the
//! planner needs to know: the size of the trace, its parameters and, for now, the naive plan
//! (every value its own bytes). The lifetime-based planner (issue 3) replaces `plan_naive` here.

use clap::Args;
use rumble_core::ir::InputRole;
use rumble_core::plan::plan_naive;
use rumble_models::{Result, build_train_step};
use serde_json::json;

use crate::common::{ModelArgs, human};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print the whole trace in rumble's text form.
    #[arg(long)]
    pub trace: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let r = a.model.resolve(None)?;
    let step = build_train_step(&r.config, &r.step)?;
    let (trace, log) = rumble_core::passes::run(&step.trace, rumble_models::trainer::PIPELINE)?;
    let t = &trace;
    if a.trace {
        println!("{t}");
    }
    let plan = plan_naive(t, 0);
    let bytes_of = |role: InputRole| -> usize {
        t.inputs.iter().filter(|i| i.role == role).map(|i| t.ty(i.value).size_in_bytes()).sum()
    };
    let (params, states) = (bytes_of(InputRole::Param), bytes_of(InputRole::OptState));
    if a.json {
        let ops: serde_json::Map<String, serde_json::Value> =
            t.op_counts().into_iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        println!(
            "{}",
            json!({"model": r.name, "nodes": t.nodes.len(), "values": t.num_values(), "inputs": t.inputs.len(),
                   "outputs": t.outputs.len(), "param_bytes": params, "opt_state_bytes": states,
                   "planner": "naive", "arena_bytes": plan.arena_bytes, "persistent_bytes": plan.persistent_bytes,
                   "ops": ops})
        );
        return Ok(());
    }
    for l in &log {
        println!("pass {l}");
    }
    println!(
        "{}: {} nodes, {} values, {} inputs, {} outputs",
        t.name,
        t.nodes.len(),
        t.num_values(),
        t.inputs.len(),
        t.outputs.len()
    );
    println!("parameters {}B, optimizer state {}B", human(params as f64), human(states as f64));
    println!(
        "naive plan (no reuse; the lifetime planner replaces it): arena {}B, persistent {}B",
        human(plan.arena_bytes as f64),
        human(plan.persistent_bytes as f64)
    );
    let ops: Vec<String> = t.op_counts().into_iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!("ops: {}", ops.join(", "));
    Ok(())
}
