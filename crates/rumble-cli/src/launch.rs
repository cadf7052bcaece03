//! How this process takes part in a run (issue 20): alone, as the parent of `--gpus N`
//! processes on this host, or as one rank of a run started by torchrun (or anything that sets
//! its environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`). Both are read into one [`Launch`], checked, with an error naming the flag or
//! variable at fault.
//!
//! A data-parallel run (`world > 1`): `--gpus N` starts N copies of this command with the
//! torchrun variables set (a free local port as `MASTER_PORT`) and waits for them
//! ([`run_ranks`]); each rank [`join`]s the run: it binds device `LOCAL_RANK`, meets the others
//! at rank 0 over TCP (`rumble_models::rendezvous`, which hands out rank 0's NCCL unique id on
//! CUDA) and keeps those links (`rumble_models::group`); the trainer then builds the rank's
//! trace (`rumble_core::passes::data_parallel`) and takes the rank's rows of every global batch.

use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rumble_models::group::Group;
use rumble_models::{DeviceChoice, DeviceKind, ModelError, Result, rendezvous};

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
    /// Rank 0's address and the port of rumble's rendezvous there, when the environment gives
    /// them: `MASTER_PORT`, or the port after it where torchrun's agent serves its own store
    /// at `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`).
    pub master: Option<(String, u16)>,
}

/// The torchrun variables, in the order they are checked.
pub const TORCHRUN_VARS: [&str; 6] =
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];

/// Reads `--gpus` and the torchrun variables (`env` looks one up) into a [`Launch`].
pub fn resolve(gpus: Option<usize>, env: &dyn Fn(&str) -> Option<String>) -> std::result::Result<Launch, String> {
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
    let int = |name: &str, required: bool| -> std::result::Result<Option<usize>, String> {
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
            // torchrun's agent holds MASTER_PORT (its TCPStore): rumble meets at the next one.
            let port = if env("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim() == "True") {
                port.checked_add(1).ok_or("MASTER_PORT=65535 is torchrun's store; rumble needs the port after it")?
            } else {
                port
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

/// Checks that the devices of `--gpus N` exist (`devices` says whether device `i` opens, with
/// the reason when not); nothing to check otherwise.
pub fn check_gpus(
    l: &Launch,
    devices: &dyn Fn(usize) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    if l.source != LaunchSource::Gpus || l.world == 1 {
        return Ok(());
    }
    // Devices 0..N must all exist; the last one tells.
    devices(l.world - 1).map_err(|why| format!("--gpus {} needs {} CUDA devices: {why}", l.world, l.world))
}

/// This command's arguments for a rank of `--gpus N`: the same, without `--gpus N`.
pub fn rank_args(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        match a.to_str() {
            Some("--gpus") => skip = true,
            Some(s) if s.starts_with("--gpus=") => {}
            _ => out.push(a.clone()),
        }
    }
    out
}

/// The device a rank binds: the `local_rank`-th of `CUDA_VISIBLE_DEVICES` (`visible`) where it
/// is set, else device `local_rank`.
pub fn visible_device(local_rank: usize, visible: Option<&str>) -> std::result::Result<String, String> {
    let Some(v) = visible else { return Ok(local_rank.to_string()) };
    let list: Vec<&str> = v.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    list.get(local_rank).map(|d| d.to_string()).ok_or_else(|| {
        format!("LOCAL_RANK={local_rank}, but CUDA_VISIBLE_DEVICES=`{v}` lists {} device(s)", list.len())
    })
}

/// A port nobody listens at now on this host (the OS's pick), for `--gpus`'s rendezvous.
fn free_port() -> std::result::Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free local port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| format!("no free local port: {e}"))
}

/// How long a rank may take to exit after its peers are told to stop, before it is killed.
const GRACE: Duration = Duration::from_secs(60);

/// `--gpus N`: runs `exe args` (this command without `--gpus`) as ranks 0 to `world - 1` with
/// torchrun's variables set (rank 0 at a free local port), waits for all, and returns the exit
/// code of the run: 0, or the first failing rank's. A rank that fails gets the others a
/// SIGTERM (they stop after their step; rank 0 saves its checkpoint), and a SIGKILL after a
/// grace period. Each rank has its own process group, so a Ctrl-C reaches this process only,
/// which passes SIGINT and SIGTERM on once (a second one kills the ranks).
///
/// `lib_dir`, where given, goes first on the ranks' `LD_LIBRARY_PATH` ([`nccl_dir`]).
pub fn run_ranks(
    world: usize,
    exe: &Path,
    args: &[OsString],
    lib_dir: Option<&Path>,
) -> std::result::Result<i32, String> {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let port = free_port()?;
    let ld_path = lib_dir.map(|d| {
        let mut p = d.as_os_str().to_owned();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
            p.push(":");
            p.push(old);
        }
        p
    });
    let mut ranks = Vec::with_capacity(world);
    for r in 0..world {
        let mut c = std::process::Command::new(exe);
        c.args(args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .process_group(0);
        if let Some(p) = &ld_path {
            c.env("LD_LIBRARY_PATH", p);
        }
        match c.spawn() {
            Ok(child) => ranks.push(Some(child)),
            Err(e) => {
                for child in ranks.iter_mut().flatten() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(format!("cannot start rank {r} ({}): {e}", exe.display()));
            }
        }
    }
    let signal = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, signal.clone(), sig as usize)
            .map_err(|e| format!("cannot handle signal {sig}: {e}"))?;
    }
    let send = |ranks: &[Option<std::process::Child>], sig: i32| {
        for child in ranks.iter().flatten() {
            // SAFETY: kill(2) on the pid of a child not yet waited for.
            unsafe {
                libc::kill(child.id() as libc::pid_t, sig);
            }
        }
    };
    let mut code = 0;
    let mut forwarded = 0;
    let mut kill_at: Option<Instant> = None;
    while ranks.iter().any(Option::is_some) {
        for (r, slot) in ranks.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            let status = match child.try_wait() {
                Ok(Some(st)) => st,
                Ok(None) => continue,
                Err(e) => return Err(format!("waiting for rank {r}: {e}")),
            };
            *slot = None;
            let c = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            if c != 0 && code == 0 {
                code = c;
                crate::note!("rank {r} exited with status {c}; stopping the other ranks");
                kill_at = Some(Instant::now() + GRACE);
            }
        }
        if let Some(t) = kill_at {
            if forwarded == 0 {
                send(&ranks, libc::SIGTERM);
                forwarded = libc::SIGTERM as usize;
            }
            if Instant::now() >= t {
                send(&ranks, libc::SIGKILL);
            }
        }
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            if forwarded == 0 {
                send(&ranks, sig as i32);
                forwarded = sig;
                kill_at.get_or_insert(Instant::now() + GRACE);
            } else {
                send(&ranks, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(code)
}

/// Where the ranks of `--gpus N` find NCCL: `None` when it loads as it is; else a folder
/// holding a `libnccl.so` link to the `libnccl.so.2` found on this machine (PyTorch's wheel,
/// say), under the temporary folder; an error naming what was looked for when there is none.
pub fn nccl_dir() -> Result<Option<std::path::PathBuf>> {
    let Err(missing) = rumble_cuda::nccl::available() else { return Ok(None) };
    let Some(lib) = rumble_cuda::nccl::find_library() else { return Err(missing.into()) };
    // SAFETY: getuid(2) always succeeds and touches no memory.
    let uid = unsafe { libc::getuid() };
    let root = std::env::temp_dir().join(format!("rumble-{uid}"));
    Ok(Some(rumble_cuda::nccl::link_dir_for(&lib, &root)?))
}

/// How long a rank waits for the others at the rendezvous.
const RENDEZVOUS: Duration = Duration::from_secs(300);

/// A rank of a data-parallel run, joined: its links to the others, its device, and what must
/// live as long as the run (the CUDA device of the NCCL communicator).
pub struct Joined {
    pub group: Arc<Group>,
    pub kind: DeviceKind,
    _device: Option<Arc<rumble_cuda::Device>>,
}

/// Joins the run `l` (`world > 1`, this process one rank of it): on CUDA binds the rank's GPU
/// (`CUDA_VISIBLE_DEVICES` narrowed to it, so device 0 is the rank's everywhere after), meets
/// the other ranks at rank 0 ([`rendezvous`]: rank 0 serves its NCCL unique id on CUDA),
/// checks that all run on the same kind of device, and installs the process's communicator:
/// NCCL's on CUDA, the group's TCP links for the CPU reference.
pub fn join(l: &Launch, device: DeviceChoice) -> Result<Joined> {
    let usage = ModelError::Usage;
    if device != DeviceChoice::Cpu {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let d = visible_device(l.local_rank, visible.as_deref()).map_err(usage)?;
        // SAFETY: set before this process starts CUDA or any thread that reads the environment.
        unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", d) };
    }
    let kind = device.resolve()?;
    let (addr, port) = l.master.clone().ok_or_else(|| usage("MASTER_ADDR and MASTER_PORT are not set".into()))?;
    let (world, rank) = (l.world, l.rank);
    let (id, group) = if rank == 0 {
        let id = match kind {
            DeviceKind::Cuda => rumble_cuda::nccl::unique_id()?,
            DeviceKind::Cpu => [0; rendezvous::ID_BYTES],
        };
        (id, Group::root(rendezvous::serve(&addr, port, world, &id, RENDEZVOUS)?))
    } else {
        let (id, link) = rendezvous::fetch(&addr, port, rank, world, RENDEZVOUS)?;
        (id, Group::member(link, rank, world))
    };
    // The same device on every rank: the largest and the smallest kind agree.
    let code = u64::from(kind == DeviceKind::Cuda);
    let (most, least) = (group.agree(code)?, 1 - group.agree(1 - code)?);
    if most != least {
        return Err(usage(format!(
            "rank {rank} runs on {kind}, and some other rank does not: give every rank --device"
        )));
    }
    let group = Arc::new(group);
    let device = match kind {
        DeviceKind::Cuda => {
            let dev = rumble_cuda::Device::new(0)?;
            rumble_cuda::nccl::Comm::new(&dev, &id, world, rank)?.install();
            Some(dev)
        }
        DeviceKind::Cpu => {
            rumble_core::cpu::collective::install(group.clone());
            None
        }
    };
    Ok(Joined { group, kind, _device: device })
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
        // Under torchrun's agent store, rumble meets at the port after MASTER_PORT.
        let mut agent = TORCHRUN.to_vec();
        agent.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert_eq!(resolve(None, &env(&agent)).unwrap().master, Some(("node0.cluster".into(), 29501)));
        agent.pop();
        agent.push(("TORCHELASTIC_USE_AGENT_STORE", "False"));
        assert_eq!(resolve(None, &env(&agent)).unwrap().master, Some(("node0.cluster".into(), 29500)));
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
    fn gpus_needs_its_devices_and_ranks_drop_the_flag() {
        let one = resolve(None, &env(&[])).unwrap();
        assert!(check_gpus(&one, &|_| Err("none".into())).is_ok());
        let two = resolve(Some(2), &env(&[])).unwrap();
        let e = check_gpus(&two, &|i| Err(format!("device {i} asked for, 1 present"))).unwrap_err();
        assert!(e.contains("--gpus 2 needs 2 CUDA devices: device 1 asked for, 1 present"), "{e}");
        assert!(check_gpus(&two, &|_| Ok(())).is_ok());
        // Under torchrun the launcher placed the ranks: nothing to check.
        assert!(check_gpus(&resolve(None, &env(&TORCHRUN)).unwrap(), &|_| Err("x".into())).is_ok());
        let args = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            rank_args(&args(&["train", "--gpus", "2", "--steps", "5", "--gpus=4", "--json"])),
            args(&["train", "--steps", "5", "--json"])
        );
    }

    #[test]
    fn a_rank_binds_its_visible_device() {
        assert_eq!(visible_device(1, None).unwrap(), "1");
        assert_eq!(visible_device(1, Some("4, 6,7")).unwrap(), "6");
        let e = visible_device(2, Some("3,5")).unwrap_err();
        assert!(e.contains("LOCAL_RANK=2") && e.contains("lists 2 device(s)"), "{e}");
    }

    #[test]
    fn the_launcher_returns_the_first_failure_and_stops_the_others() {
        // `sh -c SCRIPT rank` stands in for a rank: rank 1 fails at once; rank 0 would sleep
        // for a minute but is stopped by the SIGTERM the failure sends.
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; \
                      [ \"$WORLD_SIZE\" = 2 ] && [ \"$MASTER_ADDR\" = 127.0.0.1 ] && [ -n \"$MASTER_PORT\" ] || exit 9; \
                      sleep 60";
        let t = Instant::now();
        let code = run_ranks(2, Path::new("/bin/sh"), &[OsString::from("-c"), OsString::from(script)], None).unwrap();
        assert_eq!(code, 3);
        assert!(t.elapsed() < Duration::from_secs(30), "rank 0 was not stopped: {:?}", t.elapsed());
        // The library folder goes first on the ranks' loader path.
        let check = "case \"$LD_LIBRARY_PATH\" in /opt/nccl-here*) exit 0;; *) exit 4;; esac";
        let ok = run_ranks(
            3,
            Path::new("/bin/sh"),
            &[OsString::from("-c"), OsString::from(check)],
            Some(Path::new("/opt/nccl-here")),
        )
        .unwrap();
        assert_eq!(ok, 0);
    }
}
