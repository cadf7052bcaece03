//! How the ranks of a data-parallel run agree on one NCCL unique id (issue 20): rank 0 makes
//! it and serves it over TCP at `MASTER_ADDR:MASTER_PORT` (torchrun's rendezvous variables);
//! every other rank connects, says which run and rank it is, and reads it. Plain `std::net`,
//! no other dependency; each side gives up after a deadline with an error naming the address,
//! so a rank started without its peers does not hang.
//!
//! The exchange, after rank `r` connects: it sends `MAGIC`, the world size and its rank (8
//! bytes each, little-endian); rank 0 checks them and answers `MAGIC` and the id, or `REFUSE`
//! and a reason. A rank that was told a different world size, or a second connection for one
//! rank, is an error on both sides.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{ModelError, Result};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub use rumble_cuda::nccl::ID_BYTES;
const MAGIC: &[u8; 8] = b"rumbleid";
const REFUSE: &[u8; 8] = b"rumbleno";
/// Pause between a rank's attempts to reach rank 0.
const RETRY: Duration = Duration::from_millis(50);

fn err(what: String) -> ModelError {
    ModelError::Usage(format!("rendezvous: {what}"))
}

/// Rank 0: listens at `addr`, sends `id` to each of the other `world - 1` ranks, returns when
/// all have it (or `timeout` has passed: an error naming the ranks that never came), with the
/// connection to each, in rank order (ranks 1 to `world - 1`).
pub fn serve(addr: &str, port: u16, world: usize, id: &[u8; ID_BYTES], timeout: Duration) -> Result<Vec<TcpStream>> {
    let listener =
        TcpListener::bind((addr, port)).map_err(|e| err(format!("rank 0 cannot listen at {addr}:{port}: {e}")))?;
    serve_on(listener, world, id, timeout)
}

/// [`serve`] on a listener already bound (tests bind port 0).
pub fn serve_on(listener: TcpListener, world: usize, id: &[u8; ID_BYTES], timeout: Duration) -> Result<Vec<TcpStream>> {
    let at = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    listener.set_nonblocking(true).map_err(|e| err(format!("{at}: {e}")))?;
    let deadline = Instant::now() + timeout;
    let mut served: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut waiting = world - 1;
    while waiting > 0 {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| err(format!("{at}: {e}")))?;
                s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(RETRY)))
                    .map_err(|e| err(format!("{at}: {e}")))?;
                let mut hello = [0u8; 24];
                s.read_exact(&mut hello).map_err(|e| err(format!("{at}: a rank's greeting: {e}")))?;
                let (w, r) = (u64_at(&hello, 8) as usize, u64_at(&hello, 16) as usize);
                let refuse = if &hello[..8] != MAGIC {
                    Some("not a rumble rank".to_string())
                } else if w != world {
                    Some(format!("rank {r} was started for {w} ranks, rank 0 for {world}"))
                } else if r == 0 || r >= world {
                    Some(format!("rank {r} is outside 1..{world}"))
                } else if served[r].is_some() {
                    Some(format!("rank {r} connected twice"))
                } else {
                    None
                };
                if let Some(why) = refuse {
                    let _ = s.write_all(&[&REFUSE[..], why.as_bytes()].concat());
                    return Err(err(format!("{at}: {why}")));
                }
                s.write_all(&[&MAGIC[..], &id[..]].concat())
                    .map_err(|e| err(format!("{at}: sending rank {r} the id: {e}")))?;
                served[r] = Some(keep(s).map_err(|e| err(format!("{at}: rank {r}'s connection: {e}")))?);
                waiting -= 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> =
                        (1..world).filter(|&r| served[r].is_none()).map(|r| r.to_string()).collect();
                    return Err(err(format!(
                        "rank 0 at {at} waited {timeout:?}; ranks {} never connected",
                        missing.join(", ")
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(err(format!("{at}: accepting a rank: {e}"))),
        }
    }
    Ok(served.into_iter().skip(1).flatten().collect())
}

/// A connection kept after the greeting: blocking with no deadline (a rank may wait long for
/// another's step or checkpoint; a peer that dies closes it), small messages sent at once.
fn keep(s: TcpStream) -> std::io::Result<TcpStream> {
    s.set_read_timeout(None)?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Rank `rank > 0` of `world`: connects to rank 0 at `addr:port` (retrying until `timeout`,
/// since rank 0 may not be listening yet) and returns the id it serves, with the connection.
pub fn fetch(
    addr: &str,
    port: u16,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<([u8; ID_BYTES], TcpStream)> {
    if rank == 0 || rank >= world {
        return Err(err(format!("rank {rank} of {world} does not fetch the id (rank 0 serves it)")));
    }
    let deadline = Instant::now() + timeout;
    let target = (addr, port)
        .to_socket_addrs()
        .map_err(|e| err(format!("MASTER_ADDR {addr}:{port}: {e}")))?
        .next()
        .ok_or_else(|| err(format!("MASTER_ADDR {addr}:{port} names no address")))?;
    let mut s = loop {
        match TcpStream::connect_timeout(&target, RETRY) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(err(format!(
                    "rank {rank} could not reach rank 0 at {addr}:{port} in {timeout:?} (last: {e}); is rank 0 running?"
                )));
            }
            Err(_) => std::thread::sleep(RETRY),
        }
    };
    s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(RETRY)))
        .map_err(|e| err(format!("{addr}:{port}: {e}")))?;
    let hello = [&MAGIC[..], &(world as u64).to_le_bytes(), &(rank as u64).to_le_bytes()].concat();
    s.write_all(&hello).map_err(|e| err(format!("rank {rank} greeting rank 0 at {addr}:{port}: {e}")))?;
    let mut head = [0u8; 8];
    s.read_exact(&mut head).map_err(|e| err(format!("rank {rank} waiting for rank 0's answer: {e}")))?;
    if &head == REFUSE {
        let mut why = String::new();
        let _ = s.read_to_string(&mut why);
        return Err(err(format!("rank 0 at {addr}:{port} refused rank {rank}: {why}")));
    }
    if &head != MAGIC {
        return Err(err(format!("{addr}:{port} is not a rumble rank 0")));
    }
    let mut id = [0u8; ID_BYTES];
    s.read_exact(&mut id).map_err(|e| err(format!("rank {rank} reading the id: {e}")))?;
    Ok((id, keep(s).map_err(|e| err(format!("{addr}:{port}: {e}")))?))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (TcpListener, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (l, port)
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let (l, port) = listener();
        let world = 4;
        let got: Vec<[u8; ID_BYTES]> = std::thread::scope(|s| {
            let server = s.spawn(|| serve_on(l, world, &id, Duration::from_secs(10)));
            let ranks: Vec<_> = (1..world)
                .map(|r| s.spawn(move || fetch("127.0.0.1", port, r, world, Duration::from_secs(10))))
                .collect();
            let got = ranks.into_iter().map(|h| h.join().unwrap().unwrap().0).collect();
            assert_eq!(server.join().unwrap().unwrap().len(), world - 1, "a connection per rank");
            got
        });
        assert!(got.iter().all(|g| *g == id));
    }

    #[test]
    fn a_rank_started_for_another_world_is_refused_on_both_sides() {
        let (l, port) = listener();
        let id = [1u8; ID_BYTES];
        let (served, fetched) = std::thread::scope(|s| {
            let server = s.spawn(|| serve_on(l, 3, &id, Duration::from_secs(10)));
            let rank = s.spawn(move || fetch("127.0.0.1", port, 1, 2, Duration::from_secs(10)));
            (server.join().unwrap(), rank.join().unwrap())
        });
        let (a, b) = (served.unwrap_err().to_string(), fetched.unwrap_err().to_string());
        assert!(a.contains("rank 1 was started for 2 ranks, rank 0 for 3"), "{a}");
        assert!(b.contains("refused rank 1") && b.contains("started for 2 ranks"), "{b}");
    }

    #[test]
    fn lone_ranks_give_up_with_the_address() {
        let (l, port) = listener();
        drop(l); // nobody listens there now
        let e = fetch("127.0.0.1", port, 2, 3, Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains(&format!("rank 2 could not reach rank 0 at 127.0.0.1:{port}")), "{e}");
        let (l, _) = listener();
        let e = serve_on(l, 3, &[0; ID_BYTES], Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("ranks 1, 2 never connected"), "{e}");
        let e = fetch("127.0.0.1", port, 0, 3, Duration::from_millis(10)).unwrap_err().to_string();
        assert!(e.contains("rank 0 serves it"), "{e}");
    }
}
