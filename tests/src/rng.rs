//! xorshift64*: reproducible kill points from a printed seed (no crate needed for a few
//! random delays, and the sequence must not change under a dependency update).

use std::time::Duration;

pub struct Rng(pub u64);

impl Rng {
    /// Seeded from `var` when it is set (to replay a failure), else from the clock.
    pub fn from_env(var: &str) -> Rng {
        let seed = std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        // xorshift never leaves 0.
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A duration in [0, d).
    pub fn below(&mut self, d: Duration) -> Duration {
        Duration::from_micros(self.next_u64() % d.as_micros().max(1) as u64)
    }
}
