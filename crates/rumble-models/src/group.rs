//! The host links of a data-parallel run (issue 20): after the rendezvous every rank keeps its
//! TCP connection to rank 0 (rank 0 one per rank), a star over which the ranks exchange what
//! the host must agree on. A [`Group`] carries
//!
//! - the collectives of the CPU reference ([`rumble_core::cpu::collective::HostComm`]): rank 0
//!   receives every rank's operand, computes every result by `combine`'s rule (sums in rank
//!   order, in f64) and sends each rank its own, so the CPU ranks agree bit for bit with the
//!   lockstep simulator (on CUDA the step's collectives go through NCCL instead);
//! - [`Group::agree`]: the largest of the ranks' flags, once a step, so a signal or a failed
//!   write seen by one rank stops every rank after the same step (none is left waiting in a
//!   collective);
//! - [`Group::gather`]: every rank's bytes at rank 0 (sharded optimizer state for a checkpoint,
//!   the flags that shaped each rank's run); [`Group::sum`]: sums of host numbers (validation).
//!
//! Every exchange is a frame: a 16-byte header (tag, collective, dtype, 5 zero bytes, payload
//! length as a little-endian u64), then the payload. Rank 0 checks that every rank sent the
//! same kind of frame, and a rank that left (its connection closed) is an error naming it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;

use rumble_core::DType;
use rumble_core::cpu::collective::{HostComm, combine};
use rumble_core::ir::CollectiveOp;

use crate::error::{ModelError, Result};

const COLLECTIVE: u8 = 1;
const AGREE: u8 = 2;
const GATHER: u8 = 3;
const HEADER: usize = 16;

/// One rank's links: rank 0 holds one connection per other rank (in rank order), every other
/// rank its connection to rank 0.
pub struct Group {
    world: usize,
    rank: usize,
    links: Mutex<Vec<TcpStream>>,
}

/// What a frame says, besides its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Kind {
    tag: u8,
    op: u8,
    dtype: u8,
    len: u64,
}

impl Kind {
    fn describe(&self) -> String {
        let what = match self.tag {
            COLLECTIVE => CollectiveOp::ALL.get(self.op as usize).map_or("a collective", |o| o.name()),
            AGREE => "the step's agreement",
            GATHER => "a gather",
            _ => "an unknown message",
        };
        let dtype = DType::ALL.get(self.dtype as usize).map_or("?", |d| d.name());
        format!("{what} ({} bytes of {dtype})", self.len)
    }
}

fn code<T: PartialEq>(all: &[T], x: T) -> u8 {
    all.iter().position(|a| *a == x).unwrap_or(u8::MAX as usize) as u8
}

fn err(what: String) -> ModelError {
    ModelError::Usage(format!("data-parallel group: {what}"))
}

impl Group {
    /// Rank 0's group over `links`, the connections to ranks 1 to `links.len()` in order.
    pub fn root(links: Vec<TcpStream>) -> Group {
        Group { world: links.len() + 1, rank: 0, links: Mutex::new(links) }
    }

    /// Rank `rank`'s group of `world` over its connection to rank 0.
    pub fn member(link: TcpStream, rank: usize, world: usize) -> Group {
        Group { world, rank, links: Mutex::new(vec![link]) }
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The largest of every rank's `flag` (a stop request, say), the same on every rank.
    pub fn agree(&self, flag: u64) -> Result<u64> {
        let kind = Kind { tag: AGREE, op: 0, dtype: 0, len: 8 };
        let out = self.exchange(kind, &flag.to_le_bytes(), |parts| {
            let max = parts.iter().map(|p| u64::from_le_bytes(p[..8].try_into().expect("8 bytes"))).max();
            Ok(vec![max.unwrap_or(0).to_le_bytes().to_vec(); parts.len()])
        })?;
        Ok(u64::from_le_bytes(out[..8].try_into().map_err(|_| err("a short agreement".into()))?))
    }

    /// Every rank's `bytes` (of any length), in rank order, at rank 0; `None` elsewhere.
    pub fn gather(&self, bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        let kind = Kind { tag: GATHER, op: 0, dtype: 0, len: bytes.len() as u64 };
        let mut all = None;
        self.exchange(kind, bytes, |parts| {
            all = Some(parts.iter().map(|p| p.to_vec()).collect());
            Ok(vec![Vec::new(); parts.len()])
        })?;
        Ok(all)
    }

    /// The sums over ranks of `xs` (elementwise, in rank order), the same bits on every rank.
    pub fn sum(&self, xs: &[f64]) -> Result<Vec<f64>> {
        let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let out = self.collective(CollectiveOp::AllReduce, DType::F64, &bytes)?;
        Ok(out.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }

    /// Runs one exchange: every rank sends `mine` as a frame of `kind`; rank 0 checks that they
    /// agree, computes every rank's answer with `answer` (given the payloads in rank order) and
    /// sends each its own.
    fn exchange(
        &self,
        kind: Kind,
        mine: &[u8],
        answer: impl FnOnce(&[&[u8]]) -> rumble_core::Result<Vec<Vec<u8>>>,
    ) -> Result<Vec<u8>> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if self.world == 1 {
            let out = answer(&[mine]).map_err(|e| err(e.to_string()))?;
            return Ok(out.into_iter().next().unwrap_or_default());
        }
        if self.rank != 0 {
            let link = &mut links[0];
            let lost =
                |e: std::io::Error| err(format!("rank {} lost rank 0 during {}: {e}", self.rank, kind.describe()));
            send(link, kind, mine).map_err(lost)?;
            let (back, payload) = receive(link).map_err(lost)?;
            if back.tag != kind.tag {
                return Err(err(format!(
                    "rank 0 answered {} to rank {}'s {}",
                    back.describe(),
                    self.rank,
                    kind.describe()
                )));
            }
            return Ok(payload);
        }
        let mut parts = vec![mine.to_vec()];
        for (i, link) in links.iter_mut().enumerate() {
            let r = i + 1;
            let (got, payload) =
                receive(link).map_err(|e| err(format!("rank {r} left the run during {}: {e}", kind.describe())))?;
            // A gather's pieces may differ in length; everything else is the same on every rank.
            let same = if kind.tag == GATHER { Kind { len: kind.len, ..got } == kind } else { got == kind };
            if !same {
                return Err(err(format!(
                    "rank 0 is at {}, rank {r} at {}: the ranks run different steps",
                    kind.describe(),
                    got.describe()
                )));
            }
            parts.push(payload);
        }
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let mut out = answer(&views).map_err(|e| err(e.to_string()))?.into_iter();
        let own = out.next().unwrap_or_default();
        for (i, (link, res)) in links.iter_mut().zip(out).enumerate() {
            let back = Kind { len: res.len() as u64, ..kind };
            send(link, back, &res).map_err(|e| err(format!("rank {} left the run: {e}", i + 1)))?;
        }
        Ok(own)
    }
}

impl HostComm for Group {
    fn world(&self) -> usize {
        self.world
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn collective(&self, op: CollectiveOp, dtype: DType, x: &[u8]) -> rumble_core::Result<Vec<u8>> {
        let kind = Kind {
            tag: COLLECTIVE,
            op: code(&CollectiveOp::ALL, op),
            dtype: code(&DType::ALL, dtype),
            len: x.len() as u64,
        };
        self.exchange(kind, x, |parts| combine(op, dtype, parts))
            .map_err(|e| rumble_core::Error::runtime(op.name(), e.to_string()))
    }
}

fn send(s: &mut TcpStream, k: Kind, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; HEADER];
    head[0] = k.tag;
    head[1] = k.op;
    head[2] = k.dtype;
    head[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(payload)?;
    s.flush()
}

/// The most bytes a frame may carry (a corrupt header is not an allocation of exabytes).
const MAX_PAYLOAD: u64 = 1 << 40;

fn receive(s: &mut TcpStream) -> std::io::Result<(Kind, Vec<u8>)> {
    let mut head = [0u8; HEADER];
    s.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a frame of {len} bytes")));
    }
    let mut payload = vec![0u8; len as usize];
    s.read_exact(&mut payload)?;
    Ok((Kind { tag: head[0], op: head[1], dtype: head[2], len }, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::{ID_BYTES, fetch, serve_on};
    use rumble_core::cpu::write_float;
    use std::net::TcpListener;
    use std::time::Duration;

    /// `world` groups joined through the rendezvous, one per thread, each running `body`.
    fn run<T: Send>(world: usize, body: impl Fn(Group) -> T + Sync) -> Vec<T> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = Duration::from_secs(20);
        std::thread::scope(|s| {
            let body = &body;
            let mut hs = vec![s.spawn(move || body(Group::root(serve_on(l, world, &[0; ID_BYTES], t).unwrap())))];
            for r in 1..world {
                hs.push(
                    s.spawn(move || body(Group::member(fetch("127.0.0.1", port, r, world, t).unwrap().1, r, world))),
                );
            }
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_follow_combines_rule_on_every_rank() {
        let world = 3;
        let operand =
            |r: usize| write_float::<f64>(DType::F32, &(0..6).map(|i| (r * 10 + i) as f64 + 0.25).collect::<Vec<_>>());
        let got = run(world, |g| {
            let x = operand(g.rank());
            CollectiveOp::ALL.map(|op| g.collective(op, DType::F32, &x).unwrap())
        });
        let parts: Vec<Vec<u8>> = (0..world).map(operand).collect();
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        for (i, op) in CollectiveOp::ALL.into_iter().enumerate() {
            let want = combine(op, DType::F32, &views).unwrap();
            for r in 0..world {
                assert_eq!(got[r][i], want[r], "{} on rank {r}", op.name());
            }
        }
    }

    #[test]
    fn agreement_gathers_and_sums() {
        let got = run(4, |g| {
            let r = g.rank() as u64;
            let flag = g.agree(if r == 2 { 15 } else { r }).unwrap();
            let all = g.gather(&vec![r as u8; 3 + r as usize]).unwrap();
            let sum = g.sum(&[r as f64, 0.5]).unwrap();
            (flag, all, sum)
        });
        for (r, (flag, all, sum)) in got.into_iter().enumerate() {
            assert_eq!((flag, sum), (15, vec![6.0, 2.0]));
            assert_eq!(all, (r == 0).then(|| (0..4u8).map(|i| vec![i; 3 + i as usize]).collect::<Vec<_>>()));
        }
    }

    #[test]
    fn ranks_at_different_exchanges_or_gone_are_errors_naming_them() {
        let got = run(2, |g| if g.rank() == 0 { g.agree(0).map(|_| ()) } else { g.gather(&[1, 2]).map(|_| ()) });
        let e = got[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 0 is at the step's agreement") && e.contains("rank 1 at a gather"), "{e}");
        let got = run(3, |g| if g.rank() == 2 { Ok(0) } else { g.agree(1) });
        let e = got[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 2 left the run"), "{e}");
        // Rank 1 loses rank 0 (which gave up on rank 2) instead of waiting for ever.
        let e = got[1].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1 lost rank 0"), "{e}");
    }
}
