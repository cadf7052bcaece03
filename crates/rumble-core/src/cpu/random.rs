//! The one seeded random generator of rumble (test data, weight initialisation, batches): the
//! rand crate's xoshiro256++, whose output for a seed is fixed by its specification (unlike
//! `StdRng`'s), so a seed gives the same weights and batches on every platform and build.
//!
//! [`Rng::for_name`] gives each named stream (a parameter, the batches, ...) its own generator,
//! so that adding a stream does not change the others.

use std::hash::Hasher;

use fnv::FnvHasher;
use rand::distr::uniform::SampleUniform;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng as _, RngExt as _, SeedableRng};
use rand_distr::StandardNormal;

#[derive(Clone, Debug)]
pub struct Rng(Xoshiro256PlusPlus);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    /// The generator of the stream `name` of `seed`.
    pub fn for_name(seed: u64, name: &str) -> Self {
        let mut h = FnvHasher::default();
        h.write(name.as_bytes());
        Rng::new(seed ^ h.finish().rotate_left(17))
    }

    /// The generator's whole state, as JSON (for a checkpoint): [`Rng::from_state`] of it
    /// continues exactly where `self` is.
    pub fn state(&self) -> serde_json::Value {
        serde_json::to_value(&self.0).unwrap_or(serde_json::Value::Null)
    }

    /// The generator [`Rng::state`] returned, or `None` when `v` is not such a state.
    pub fn from_state(v: &serde_json::Value) -> Option<Rng> {
        serde_json::from_value(v.clone()).ok().map(Rng)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0.random()
    }

    /// Uniform integer in `0..hi` (0 when `hi` is 0).
    pub fn below<T: SampleUniform + PartialOrd + Default>(&mut self, hi: T) -> T {
        if hi <= T::default() { T::default() } else { self.0.random_range(T::default()..hi) }
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        self.0.sample(StandardNormal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_have_their_law_and_streams_differ() {
        let mut r = Rng::new(7);
        let xs: Vec<f64> = (0..20000).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        let us: Vec<f64> = (0..20000).map(|_| r.uniform()).collect();
        assert!(us.iter().all(|u| (0.0..1.0).contains(u)));
        assert!((us.iter().sum::<f64>() / us.len() as f64 - 0.5).abs() < 0.01);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            seen[r.below(7usize)] += 1;
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
        assert_eq!(r.below(0u64), 0);
        assert_ne!(Rng::for_name(1, "a").next_u64(), Rng::for_name(1, "b").next_u64());
        assert_eq!(Rng::for_name(1, "a").next_u64(), Rng::for_name(1, "a").next_u64());
        assert_eq!(Rng::new(3).next_u64(), Rng::new(3).next_u64());
        let mut a = Rng::new(9);
        a.normal();
        let mut b = Rng::from_state(&a.state()).unwrap();
        assert_eq!(a.next_u64(), b.next_u64());
        assert!(Rng::from_state(&serde_json::json!(3)).is_none());
    }
}
