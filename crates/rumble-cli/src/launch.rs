//! How this process takes part in a run (issue 20): alone, as the parent of `--gpus N`
//! processes on this host, or as one rank of a run started by torchrun (or anything that sets
//! its environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`). Both are read into one [`Launch`], checked, with an error naming the flag or
//! variable at fault.
//!
//! Data-parallel runs (`world > 1`) are refused for now: the rank traces exist
//! (`rumble_core::passes::data_parallel`), and so does the NCCL backend that runs their
//! collectives (`rumble_cuda::nccl`), but the trainer has no rank path yet. What it will do
//! with a `Launch`: `--gpus N` starts N copies of this command with the
//! torchrun variables set (a free local port as `MASTER_PORT`), each rank binds device
//! `LOCAL_RANK`, rank 0 makes the NCCL unique id and serves it over TCP at
//! `MASTER_ADDR:MASTER_PORT` where the others fetch it (`rumble_models::rendezvous`), each
//! builds its rank trace for `world` and `rank` and takes its share of every global batch
//! (`Loader::next_rank_batch`).

/// Where a [`Launch`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchSource {
    /// One process, no data parallelism.
    Single,
    /// `--gpus N`: this process would start the N ranks of this host.
    Gpus,
    /// The torchrun environment: this process is one rank.
    Torchrun,
}

/// This process's place in a (data-parallel) run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub source: LaunchSource,
    pub world: usize,
    pub rank: usize,
    /// The rank's GPU on its host, and how many ranks its host runs.
    pub local_rank: usize,
    pub local_world: usize,
    /// Rank 0's address and port (the rendezvous), when the environment gives them.
    pub master: Option<(String, u16)>,
}

/// The torchrun variables, in the order they are checked.
pub const TORCHRUN_VARS: [&str; 6] =
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];

/// Reads `--gpus` and the torchrun variables (`env` looks one up) into a [`Launch`].
pub fn resolve(gpus: Option<usize>, env: &dyn Fn(&str) -> Option<String>) -> Result<Launch, String> {
    let set: Vec<&str> = TORCHRUN_VARS.iter().copied().filter(|v| env(v).is_some()).collect();
    if set.is_empty() {
        return match gpus {
            None | Some(1) => Ok(Launch {
                source: if gpus.is_some() { LaunchSource::Gpus } else { LaunchSource::Single },
                world: 1,
                rank: 0,
                local_rank: 0,
                local_world: 1,
                master: None,
            }),
            Some(0) => Err("--gpus must be at least 1".into()),
            Some(n) => Ok(Launch {
                source: LaunchSource::Gpus,
                world: n,
                rank: 0,
                local_rank: 0,
                local_world: n,
                master: None,
            }),
        };
    }
    if gpus.is_some() {
        return Err(format!(
            "--gpus starts its own processes; this one already runs under a launcher ({} set): leave --gpus out",
            set.join(", ")
        ));
    }
    let int = |name: &str, required: bool| -> Result<Option<usize>, String> {
        match env(name) {
            None if required => Err(format!("{name} is not set but {} are: torchrun sets them all", set.join(", "))),
            None => Ok(None),
            Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| format!("{name}=`{v}` is not a whole number")),
        }
    };
    let rank = int("RANK", true)?.unwrap_or(0);
    let world = int("WORLD_SIZE", true)?.unwrap_or(1);
    let local_rank = int("LOCAL_RANK", true)?.unwrap_or(0);
    let local_world = int("LOCAL_WORLD_SIZE", false)?;
    if world == 0 {
        return Err("WORLD_SIZE=0: a run has at least one rank".into());
    }
    if rank >= world {
        return Err(format!("RANK={rank} is not below WORLD_SIZE={world}"));
    }
    if let Some(lw) = local_world {
        if lw == 0 || lw > world {
            return Err(format!("LOCAL_WORLD_SIZE={lw} must be between 1 and WORLD_SIZE={world}"));
        }
        if local_rank >= lw {
            return Err(format!("LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={lw}"));
        }
    } else if local_rank >= world {
        return Err(format!("LOCAL_RANK={local_rank} is not below WORLD_SIZE={world}"));
    }
    let master = match (env("MASTER_ADDR"), env("MASTER_PORT")) {
        (None, None) if world == 1 => None,
        (Some(addr), Some(port)) => {
            let addr = addr.trim().to_string();
            if addr.is_empty() {
                return Err("MASTER_ADDR is empty: it names rank 0's host".into());
            }
            let port = match port.trim().parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => return Err(format!("MASTER_PORT=`{port}` is not a port (1 to 65535)")),
            };
            Some((addr, port))
        }
        (None, _) => return Err(format!("MASTER_ADDR is not set: WORLD_SIZE={world} ranks meet at rank 0's host")),
        (_, None) => return Err(format!("MASTER_PORT is not set: WORLD_SIZE={world} ranks meet at rank 0's port")),
    };
    Ok(Launch {
        source: LaunchSource::Torchrun,
        world,
        rank,
        local_rank,
        local_world: local_world.unwrap_or(world),
        master,
    })
}

/// Refuses a data-parallel launch this build cannot run: too few CUDA devices for `--gpus`
/// (`devices` says whether device `i` opens, with the reason when not), then the missing rank
/// path of the trainer.
pub fn refuse_data_parallel(l: &Launch, devices: &dyn Fn(usize) -> Result<(), String>) -> Result<(), String> {
    if l.world == 1 {
        return Ok(());
    }
    if l.source == LaunchSource::Gpus {
        // Devices 0..N must all exist; the last one tells.
        devices(l.world - 1).map_err(|why| format!("--gpus {} needs {} CUDA devices: {why}", l.world, l.world))?;
    }
    Err(format!(
        "data-parallel training over {} ranks is not built yet (issue 20: the NCCL backend exists, the \
         trainer's rank path does not); run one process without --gpus{}",
        l.world,
        if l.source == LaunchSource::Torchrun { " or with WORLD_SIZE=1" } else { "" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }
    const TORCHRUN: [(&str, &str); 6] = [
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0.cluster"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn no_flag_and_no_environment_is_one_process() {
        let l = resolve(None, &env(&[])).unwrap();
        assert_eq!((l.source, l.world, l.rank, l.master), (LaunchSource::Single, 1, 0, None));
        assert_eq!(resolve(Some(1), &env(&[])).unwrap().world, 1);
        let l = resolve(Some(4), &env(&[])).unwrap();
        assert_eq!((l.source, l.world, l.local_world), (LaunchSource::Gpus, 4, 4));
        assert!(resolve(Some(0), &env(&[])).unwrap_err().contains("--gpus must be at least 1"));
    }

    #[test]
    fn the_torchrun_environment_is_read_whole() {
        let l = resolve(None, &env(&TORCHRUN)).unwrap();
        assert_eq!(
            l,
            Launch {
                source: LaunchSource::Torchrun,
                world: 8,
                rank: 5,
                local_rank: 1,
                local_world: 4,
                master: Some(("node0.cluster".into(), 29500)),
            }
        );
        // One rank alone needs no rendezvous.
        let l = resolve(None, &env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")])).unwrap();
        assert_eq!((l.world, l.master), (1, None));
    }

    #[test]
    fn a_bad_environment_names_the_variable() {
        let with = |k: &str, v: Option<&str>| {
            let mut e: Vec<(&str, &str)> = TORCHRUN.iter().copied().filter(|(n, _)| *n != k).collect();
            if let Some(v) = v {
                e.push((k, v));
            }
            resolve(None, &env(&e)).unwrap_err()
        };
        for (k, v, want) in [
            ("RANK", Some("x"), "RANK=`x` is not a whole number"),
            ("RANK", Some("8"), "RANK=8 is not below WORLD_SIZE=8"),
            ("RANK", None, "RANK is not set"),
            ("WORLD_SIZE", Some("0"), "WORLD_SIZE=0"),
            ("WORLD_SIZE", Some("-2"), "WORLD_SIZE=`-2`"),
            ("LOCAL_RANK", Some("4"), "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
            ("LOCAL_WORLD_SIZE", Some("9"), "LOCAL_WORLD_SIZE=9 must be between 1 and WORLD_SIZE=8"),
            ("MASTER_ADDR", None, "MASTER_ADDR is not set"),
            ("MASTER_ADDR", Some(" "), "MASTER_ADDR is empty"),
            ("MASTER_PORT", Some("70000"), "MASTER_PORT=`70000` is not a port"),
            ("MASTER_PORT", Some("0"), "MASTER_PORT=`0`"),
            ("MASTER_PORT", None, "MASTER_PORT is not set"),
        ] {
            let e = with(k, v);
            assert!(e.contains(want), "{k}={v:?}: {e}");
        }
        let e = resolve(Some(2), &env(&TORCHRUN)).unwrap_err();
        assert!(e.contains("leave --gpus out") && e.contains("RANK"), "{e}");
    }

    #[test]
    fn data_parallel_runs_are_refused_with_the_reason() {
        let one = resolve(None, &env(&[])).unwrap();
        assert!(refuse_data_parallel(&one, &|_| Err("none".into())).is_ok());
        let two = resolve(Some(2), &env(&[])).unwrap();
        let e = refuse_data_parallel(&two, &|i| Err(format!("device {i} asked for, 1 present"))).unwrap_err();
        assert!(e.contains("--gpus 2 needs 2 CUDA devices: device 1 asked for, 1 present"), "{e}");
        let e = refuse_data_parallel(&two, &|_| Ok(())).unwrap_err();
        assert!(e.contains("is not built yet (issue 20"), "{e}");
        let e = refuse_data_parallel(&resolve(None, &env(&TORCHRUN)).unwrap(), &|_| Ok(())).unwrap_err();
        assert!(e.contains("over 8 ranks") && e.contains("WORLD_SIZE=1"), "{e}");
    }
}
