//! Token sampling: greedy (the on-device argmax, so only one I32 is read back), or
//! temperature with optional top-k and top-p (nucleus) filtering, drawn from a seeded
//! ChaCha generator ([`rand::rngs::StdRng`]) so runs are reproducible.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};

use crate::models::runtime::output::Output;

/// Picks the next token from a forward pass's output.
#[derive(Clone, Debug)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    rng: StdRng,
}

impl Sampler {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Sampler {
        Sampler {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            rng: StdRng::seed_from_u64(0),
        }
    }

    /// Samples from `softmax(logits / temperature)`, keeping only the `top_k` most likely
    /// tokens (`None` or 0: all) and then the smallest set whose probability reaches
    /// `top_p` (`None`: 1, all). A temperature of 0 (or top-k 1) is greedy.
    pub fn new(
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        seed: u64,
    ) -> Result<Sampler> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(Error::model(format!(
                "temperature must be a finite number >= 0, got {temperature}"
            )));
        }
        let top_p = top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(Error::model(format!(
                "top-p must be in (0, 1], got {top_p}"
            )));
        }
        Ok(Sampler {
            temperature,
            top_k: top_k.unwrap_or(0),
            top_p,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// Whether this sampler only needs the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// The next token: the argmax when greedy, else a sample from the last `vocab`
    /// logits of `out`.
    pub fn pick(&mut self, out: &Output) -> Result<u32> {
        if self.is_greedy() || out.logits.is_empty() {
            Ok(out.argmax)
        } else {
            self.sample(&out.logits)
        }
    }

    /// Samples a token from `logits` (NaN entries are never picked). Any finite positive
    /// temperature works: the logits are scaled as differences from the largest one,
    /// `(l - max) / t <= 0`, which cannot overflow, so a temperature too small to tell
    /// two logits apart picks the largest (greedy). Probabilities that are not numbers
    /// are an error, never a silent pick.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if cand.is_empty() {
            return Err(Error::model("sampling: every logit is NaN"));
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.top_k > 0 && self.top_k < cand.len() {
            cand.select_nth_unstable_by(self.top_k - 1, by_logit);
            cand.truncate(self.top_k);
        }
        // Only top-p needs the candidates in order; sampling from the whole vocabulary
        // (no top-k, no top-p) skips sorting it, which cost ~2 ms a token at 32k entries.
        if self.top_p < 1.0 || cand.len() == self.top_k {
            cand.sort_unstable_by(by_logit);
        }
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let t = self.temperature;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| ((l - max) / t).exp()).collect();
        if let Some(i) = probs.iter().position(|p| p.is_nan()) {
            return Err(Error::model(format!(
                "sampling: the probability of token {} is NaN (logit {}, temperature {t})",
                cand[i].0, cand[i].1
            )));
        }
        let total: f32 = probs.iter().sum();
        if self.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    acc += p;
                    acc >= self.top_p * total
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let kept: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * kept;
        for (i, p) in probs.iter().enumerate() {
            if r < *p {
                return Ok(cand[i].0);
            }
            r -= p;
        }
        // Rounding left r at or past the sum: the last token with any probability.
        let last = probs.iter().rposition(|&p| p > 0.0).unwrap_or(0);
        Ok(cand[last].0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = l.iter().map(|x| ((x - m) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    fn histogram(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<f64> {
        let mut h = vec![0f64; logits.len()];
        for _ in 0..n {
            h[s.sample(logits).unwrap() as usize] += 1.0;
        }
        h.iter().map(|c| c / n as f64).collect()
    }

    const LOGITS: [f32; 6] = [1.0, 2.5, -1.0, 2.0, 0.5, f32::NAN];

    #[test]
    fn greedy_uses_the_device_argmax() {
        let out = Output {
            argmax: 3,
            logits: vec![],
        };
        assert_eq!(Sampler::greedy().pick(&out).unwrap(), 3);
        assert!(Sampler::new(0.0, None, None, 1).unwrap().is_greedy());
        assert!(Sampler::new(0.8, Some(1), None, 1).unwrap().is_greedy());
        assert!(!Sampler::new(0.8, None, None, 1).unwrap().is_greedy());
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let mut s = Sampler::new(0.7, None, None, 42).unwrap();
        let h = histogram(&mut s, &LOGITS, 200_000);
        let scaled: Vec<f32> = LOGITS[..5].iter().map(|l| l / 0.7).collect();
        let p = softmax(&scaled);
        for i in 0..5 {
            assert!(
                (h[i] - p[i]).abs() < 0.005,
                "token {i}: {} vs {}",
                h[i],
                p[i]
            );
        }
        assert_eq!(h[5], 0.0, "NaN logits are never sampled");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let mut s = Sampler::new(1.0, Some(2), None, 7).unwrap();
        let h = histogram(&mut s, &LOGITS, 50_000);
        let p = softmax(&[2.5, 2.0]);
        assert!(
            (h[1] - p[0]).abs() < 0.01 && (h[3] - p[1]).abs() < 0.01,
            "{h:?}"
        );
        // top-p: probabilities (t = 1) of the sorted logits are about .50 .30 .11 .07 .02;
        // p = 0.7 keeps the first two.
        let mut s = Sampler::new(1.0, None, Some(0.7), 7).unwrap();
        let h = histogram(&mut s, &LOGITS, 50_000);
        assert!(
            h[1] > 0.5 && h[3] > 0.3 && (h[1] + h[3] - 1.0).abs() < 1e-9,
            "{h:?}"
        );
    }

    #[test]
    fn seeds_reproduce() {
        let draw = |seed| {
            let mut s = Sampler::new(1.0, Some(4), Some(0.95), seed).unwrap();
            (0..64)
                .map(|_| s.sample(&LOGITS).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    /// A temperature so small that `1 / t` overflows (or is close to it) samples the
    /// largest logit, as greedy does; it once gave the last id every time (`l * inf` is
    /// NaN at l = 0 and `inf - inf` NaN elsewhere).
    #[test]
    fn a_tiny_temperature_is_greedy() {
        let logits = [1.0, 0.0, 3.5, -2.0, 2.0, 0.25];
        for t in [1e-45, 1e-40, 1e-38, f32::MIN_POSITIVE, 1e-30, 1e-6] {
            let mut s = Sampler::new(t, None, None, 9).unwrap();
            for _ in 0..50 {
                assert_eq!(s.sample(&logits).unwrap(), 2, "temperature {t:e}");
            }
        }
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(Sampler::new(-1.0, None, None, 0).is_err());
        assert!(Sampler::new(f32::NAN, None, None, 0).is_err());
        assert!(Sampler::new(1.0, None, Some(0.0), 0).is_err());
        assert!(Sampler::new(1.0, None, Some(1.5), 0).is_err());
    }
}
