//! The sampler chain: one [`SamplerChain`] per sequence picks each next token from a
//! row of logits (the whole vocabulary, or the device's top candidates) and the
//! sequence's tokens so far, in llama.cpp's order: logit bias, repetition / presence /
//! frequency penalties over the last `repeat_last_n` tokens, top-k, typical-p, top-p,
//! min-p, temperature, then a draw from a seeded ChaCha generator
//! ([`rand::rngs::StdRng`]).
//!
//! Every filter keeps a subset of the candidates, and with top-k on, the candidates are
//! ordered by logit (ties: lower id first) before the draw, so the chain gives exactly
//! the same token from the whole row and from the [`candidates`](SamplerChain::candidates)
//! largest logits the device hands over: penalties and negative biases only lower
//! logits, so the top `k` after them lie among the top `k + touched` before them.
//!
//! Probabilities are computed in f64 from `(logit - max) / temperature <= 0`, which
//! cannot overflow for any finite positive temperature: one too small to tell two logits
//! apart picks the largest. A NaN or `+inf` logit is an [`Error::NonFinite`] naming the
//! position, never a silent pick.

use std::cmp::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::params::SamplingParams;
use crate::error::{Error, Result};
use crate::models::runtime::output::Logits;
use crate::ops::topk::MAX_K;

/// The logits one token is sampled from.
#[derive(Clone, Copy, Debug)]
pub enum Row<'a> {
    /// The whole row: one logit per token id.
    Full(&'a [f32]),
    /// The largest logits of the row with their token ids, sorted by logit, largest
    /// first (ties: lower id first), as the device's top-k gives them: at least
    /// [`SamplerChain::candidates`] of them, or the whole vocabulary.
    Top {
        /// Token ids.
        ids: &'a [u32],
        /// Their logits.
        logits: &'a [f32],
    },
}

/// One token and its logit, as the chain's filters pass them on.
type Cand = (u32, f32);

/// Larger logit first, then lower id: the order of [`Row::Top`] and of the draw.
fn by_logit(a: &Cand, b: &Cand) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Picks tokens for one sequence (see the module documentation).
#[derive(Clone, Debug)]
pub struct SamplerChain {
    params: SamplingParams,
    vocab: usize,
    seed: u64,
    rng: StdRng,
    /// The logit bias and penalties of the current step by token id (sorted by id).
    touched: Vec<(u32, Touch)>,
}

/// What the bias and the penalties do to one token's logit.
#[derive(Clone, Copy, Debug, Default)]
struct Touch {
    bias: f32,
    /// Occurrences in the penalty window.
    count: u32,
}

impl SamplerChain {
    /// A chain for a vocabulary of `vocab` tokens; checks `params`
    /// ([`SamplingParams::validate`]).
    pub fn new(params: &SamplingParams, vocab: usize) -> Result<SamplerChain> {
        params.validate(vocab)?;
        let seed = params
            .seed
            .unwrap_or_else(|| StdRng::from_os_rng().random());
        Ok(SamplerChain {
            params: params.clone(),
            vocab,
            seed,
            rng: StdRng::seed_from_u64(seed),
            touched: Vec::new(),
        })
    }

    /// A greedy chain (any vocabulary).
    pub fn greedy() -> SamplerChain {
        SamplerChain::new(&SamplingParams::greedy(), 0).expect("the greedy settings are valid")
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed of the draws (the one given, or the one drawn when none was).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the chain always picks the largest logit as it comes from the model, so
    /// the device's argmax is the token (temperature 0 or top-k 1, no bias, no penalty).
    pub fn is_greedy(&self) -> bool {
        let p = &self.params;
        (p.temperature == 0.0 || p.top_k == 1) && p.logit_bias.is_empty() && !p.penalizes()
    }

    /// How many of the largest logits (by value, before bias and penalties; ties: lower
    /// id first) give exactly the token the whole row gives, or `None` when the whole row
    /// is needed: without top-k (top-p, min-p and the draw need every token's
    /// probability), with a positive bias or a penalty that raises logits (a token from
    /// anywhere may rise to the top). Bias and penalties lower at most one token per
    /// bias entry and one per window position, which the count adds.
    pub fn candidates(&self) -> Option<usize> {
        let p = &self.params;
        let raises =
            p.repeat_penalty < 1.0 || p.presence_penalty < 0.0 || p.frequency_penalty < 0.0;
        if p.logit_bias.iter().any(|&(_, b)| b > 0.0) || (p.penalizes() && raises) {
            return None;
        }
        let window = if p.penalizes() { p.repeat_last_n } else { 0 };
        let touched = window.saturating_add(p.logit_bias.len());
        let keep = match (p.temperature == 0.0, p.top_k) {
            (true, _) => 1,
            (false, 0) => return None,
            (false, k) => k,
        };
        Some(keep.saturating_add(touched).min(self.vocab.max(1)))
    }

    /// What a forward pass must read back for this chain to pick the next token: only
    /// the argmax when greedy, the top [`candidates`](Self::candidates) when they are
    /// fewer than the vocabulary and the device selects that many
    /// ([`MAX_K`](crate::ops::topk::MAX_K)), else the last row.
    pub fn wants(&self) -> Logits {
        if self.is_greedy() {
            return Logits::None;
        }
        match self.candidates() {
            Some(k) if k < self.vocab && k <= MAX_K => Logits::Top(k),
            _ => Logits::Last,
        }
    }

    /// Samples the next token from `row`, the logits after `history` (the sequence's
    /// tokens so far, prompt included; the penalties look at its last `repeat_last_n`).
    pub fn sample(&mut self, row: Row<'_>, history: &[u32]) -> Result<u32> {
        let position = history.len().saturating_sub(1);
        let mut cand = self.candidates_of(row, position)?;
        self.touch(history);
        self.adjust(&mut cand, matches!(row, Row::Full(_)));
        let p = &self.params;
        let sorted = match p.top_k {
            0 => false,
            k => {
                top_k(&mut cand, k);
                true
            }
        };
        if p.temperature == 0.0 {
            // the largest logit after bias and penalties, ties to the lower id
            let best = cand.iter().min_by(|a, b| by_logit(a, b));
            return match best {
                Some(&(id, l)) if l > f32::NEG_INFINITY => Ok(id),
                _ => Err(all_banned(position)),
            };
        }
        let mut sorted = sorted;
        if p.typical_p < 1.0 {
            typical(&mut cand, p.typical_p);
            sorted = false;
        }
        if p.top_p < 1.0 {
            if !sorted {
                cand.sort_unstable_by(by_logit);
                sorted = true;
            }
            top_p(&mut cand, p.top_p);
        }
        if p.min_p > 0.0 {
            min_p(&mut cand, p.min_p);
        }
        if !sorted && p.top_k > 0 {
            cand.sort_unstable_by(by_logit);
        }
        self.draw(&cand, position)
    }

    /// The row's tokens as candidates; a NaN or `+inf` logit is an error.
    fn candidates_of(&self, row: Row<'_>, position: usize) -> Result<Vec<Cand>> {
        let cand: Vec<Cand> = match row {
            Row::Full(l) => {
                if l.len() != self.vocab {
                    return Err(Error::plan(format!(
                        "sampling: a row of {} logits for a vocabulary of {}",
                        l.len(),
                        self.vocab
                    )));
                }
                l.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect()
            }
            Row::Top { ids, logits } => {
                let need = self.candidates().unwrap_or(self.vocab).min(self.vocab);
                if ids.len() != logits.len() || (ids.len() < need) {
                    return Err(Error::plan(format!(
                        "sampling: {} candidate ids with {} logits; these settings need {need}",
                        ids.len(),
                        logits.len()
                    )));
                }
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab) {
                    return Err(Error::plan(format!(
                        "sampling: candidate id {id} is outside the vocabulary of {}",
                        self.vocab
                    )));
                }
                ids.iter().copied().zip(logits.iter().copied()).collect()
            }
        };
        if cand.iter().any(|c| c.1.is_nan() || c.1 == f32::INFINITY) {
            return Err(Error::NonFinite {
                position,
                step: "sampling",
            });
        }
        if cand.is_empty() {
            return Err(Error::plan("sampling from an empty row"));
        }
        Ok(cand)
    }

    /// The bias and penalty counts of this step, by token id.
    fn touch(&mut self, history: &[u32]) {
        self.touched.clear();
        let p = &self.params;
        for &(id, bias) in &p.logit_bias {
            self.touched.push((id, Touch { bias, count: 0 }));
        }
        if p.penalizes() {
            let from = history.len().saturating_sub(p.repeat_last_n);
            for &id in &history[from..] {
                self.touched.push((
                    id,
                    Touch {
                        bias: 0.0,
                        count: 1,
                    },
                ));
            }
        }
        self.touched.sort_unstable_by_key(|t| t.0);
        self.touched.dedup_by(|b, a| {
            let same = a.0 == b.0;
            if same {
                a.1.bias += b.1.bias;
                a.1.count += b.1.count;
            }
            same
        });
    }

    /// Applies the bias, then the penalties (llama.cpp's rules), to the touched tokens
    /// among `cand` (`full`: `cand[i]` is token `i`).
    fn adjust(&self, cand: &mut [Cand], full: bool) {
        if self.touched.is_empty() {
            return;
        }
        let p = &self.params;
        let apply = |l: f32, t: &Touch| {
            let mut l = l + t.bias;
            if t.count > 0 {
                l = if l > 0.0 {
                    l / p.repeat_penalty
                } else {
                    l * p.repeat_penalty
                };
                l -= t.count as f32 * p.frequency_penalty + p.presence_penalty;
            }
            l
        };
        if full {
            for (id, t) in &self.touched {
                let c = &mut cand[*id as usize];
                c.1 = apply(c.1, t);
            }
        } else {
            for c in cand.iter_mut() {
                if let Ok(i) = self.touched.binary_search_by_key(&c.0, |t| t.0) {
                    c.1 = apply(c.1, &self.touched[i].1);
                }
            }
        }
    }

    /// Draws one of `cand` with probability `exp((l - max) / t)` normalized.
    fn draw(&mut self, cand: &[Cand], position: usize) -> Result<u32> {
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(all_banned(position));
        }
        let t = self.params.temperature as f64;
        let weights: Vec<f64> = cand
            .iter()
            .map(|c| ((c.1 as f64 - max as f64) / t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        if !(total.is_finite() && total >= 1.0) {
            return Err(Error::NonFinite {
                position,
                step: "sampling",
            });
        }
        let mut r = self.rng.random::<f64>() * total;
        for (c, w) in cand.iter().zip(&weights) {
            if r < *w {
                return Ok(c.0);
            }
            r -= w;
        }
        // Rounding left r at or past the sum: the last token with any weight.
        let last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        Ok(cand[last].0)
    }
}

/// The error when no token can be drawn at `position`: every logit is -inf.
fn all_banned(position: usize) -> Error {
    Error::sampling(
        "logit_bias",
        format!("at token position {position} every token has a logit of -inf: nothing to sample"),
    )
}

/// Keeps the `k` largest of `cand`, sorted ([`by_logit`]).
fn top_k(cand: &mut Vec<Cand>, k: usize) {
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_logit);
        cand.truncate(k);
    }
    cand.sort_unstable_by(by_logit);
}

/// Probabilities of `cand` at temperature 1 (f64).
fn softmax(cand: &[Cand]) -> Vec<f64> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = cand.iter().map(|c| (c.1 as f64 - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// Keeps the shortest prefix of the sorted `cand` whose probability reaches `p` (at
/// least one token).
fn top_p(cand: &mut Vec<Cand>, p: f32) {
    let probs = softmax(cand);
    let mut acc = 0.0;
    let keep = probs
        .iter()
        .position(|&q| {
            acc += q;
            acc >= p as f64
        })
        .map_or(cand.len(), |i| i + 1);
    cand.truncate(keep);
}

/// Keeps the tokens whose logit is within `ln(1 / p)` of the largest: probability at
/// least `p` times the largest one's.
fn min_p(cand: &mut Vec<Cand>, p: f32) {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let floor = max as f64 + (p as f64).ln();
    cand.retain(|c| c.1 as f64 >= floor);
}

/// Locally typical sampling (llama.cpp's rule): the tokens ordered by how far their
/// surprise `-ln q` is from the entropy, kept until their probability passes `p` (at
/// least one token).
fn typical(cand: &mut Vec<Cand>, p: f32) {
    let probs = softmax(cand);
    let entropy: f64 = probs
        .iter()
        .filter(|&&q| q > 0.0)
        .map(|&q| -q * q.ln())
        .sum();
    let mut order: Vec<(f64, usize)> = probs
        .iter()
        .enumerate()
        .map(|(i, &q)| ((-q.ln() - entropy).abs(), i))
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(by_logit(&cand[a.1], &cand[b.1])));
    let mut acc = 0.0;
    let mut keep = order.len();
    for (n, &(_, i)) in order.iter().enumerate() {
        acc += probs[i];
        if acc > p as f64 {
            keep = n + 1;
            break;
        }
    }
    let kept: Vec<Cand> = order[..keep].iter().map(|&(_, i)| cand[i]).collect();
    *cand = kept;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The logits after bias and penalties, as the chain applies them.
    fn adjusted(p: &SamplingParams, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let mut chain = SamplerChain::new(p, logits.len()).unwrap();
        let mut cand = chain.candidates_of(Row::Full(logits), 0).unwrap();
        chain.touch(history);
        chain.adjust(&mut cand, true);
        cand.iter().map(|c| c.1).collect()
    }

    /// Penalties by hand: token 0 seen twice, 1 once, 3 once in the window of 4 (the
    /// 2 before it are out of the window); repeat 2, presence 0.5, frequency 0.25.
    #[test]
    fn penalties_match_hand_computed_values() {
        let p = SamplingParams {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repeat_last_n: 4,
            temperature: 1.0,
            ..SamplingParams::greedy()
        };
        let logits = [2.0, -1.0, 0.5, 3.0, 1.0];
        let got = adjusted(&p, &logits, &[2, 2, 0, 1, 0, 3]);
        let want = [
            2.0 / 2.0 - 2.0 * 0.25 - 0.5, // 0: twice, positive
            -2.0 - 0.25 - 0.5,            // 1: once, negative: -1 * 2
            0.5,                          // 2: only before the window
            3.0 / 2.0 - 0.25 - 0.5,       // 3: once
            1.0,                          // 4: never
        ];
        assert_eq!(got, want);
        // the repetition penalty alone (llama.cpp's default shape)
        let rp = SamplingParams {
            repeat_penalty: 1.5,
            ..p.clone()
        };
        let rp = SamplingParams {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            ..rp
        };
        assert_eq!(
            adjusted(&rp, &logits, &[0, 1, 1, 3]),
            [2.0 / 1.5, -1.5, 0.5, 2.0, 1.0]
        );
        // a window of 0 and a penalty of 1 change nothing
        let off = SamplingParams {
            repeat_last_n: 0,
            ..p.clone()
        };
        assert_eq!(adjusted(&off, &logits, &[0, 1, 3]), logits);
    }

    /// The bias comes before the penalty (llama.cpp's order), repeated entries add up,
    /// and -inf bans a token.
    #[test]
    fn bias_comes_before_the_penalties() {
        let p = SamplingParams {
            temperature: 1.0,
            repeat_penalty: 2.0,
            repeat_last_n: 8,
            logit_bias: vec![(1, 3.0), (1, 1.0), (4, f32::NEG_INFINITY), (2, -0.5)],
            ..SamplingParams::greedy()
        };
        let got = adjusted(&p, &[2.0, -1.0, 0.5, 3.0, 1.0], &[1]);
        assert_eq!(got, [2.0, 1.5, 0.0, 3.0, f32::NEG_INFINITY]);
    }

    /// Greedy after penalties: the penalty moves the pick; ties go to the lower id.
    #[test]
    fn temperature_zero_picks_the_largest_adjusted_logit() {
        let p = SamplingParams {
            repeat_penalty: 4.0,
            ..SamplingParams::greedy()
        };
        let mut chain = SamplerChain::new(&p, 4).unwrap();
        assert!(!chain.is_greedy());
        let logits = [1.0, 3.0, 2.0, 2.0];
        assert_eq!(chain.sample(Row::Full(&logits), &[]).unwrap(), 1);
        assert_eq!(chain.sample(Row::Full(&logits), &[1]).unwrap(), 2);
        // 1 + the window of 64, at most the vocabulary
        assert_eq!(chain.candidates(), Some(4));
    }
}
