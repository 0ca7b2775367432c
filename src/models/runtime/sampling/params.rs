//! The settings of the sampler chain ([`SamplingParams`]): what each sampler keeps, the
//! values that turn it off, the two sets of defaults graft uses (greedy, and llama.cpp's
//! chat settings) and the checks that name the setting a bad value belongs to.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Every setting of the sampler chain ([`SamplerChain`](super::SamplerChain)), applied
/// in llama.cpp's order: logit bias, penalties, top-k, typical-p, top-p, min-p,
/// temperature. [`Default`] is greedy decoding (temperature 0, every filter off).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits before the draw; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probabilities reach `top_p`
    /// (1: off).
    pub top_p: f32,
    /// Keep the tokens at least `min_p` times as likely as the most likely one (0: off).
    pub min_p: f32,
    /// Locally typical sampling: keep the tokens whose surprise is closest to the
    /// entropy, up to a probability mass of `typical_p` (1: off).
    pub typical_p: f32,
    /// Divides positive logits and multiplies negative ones of every token seen in the
    /// last `repeat_last_n` tokens (1: off).
    pub repeat_penalty: f32,
    /// Subtracted from the logit of every token seen in the window (0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the window (0: off).
    pub frequency_penalty: f32,
    /// The window of the penalties: the last this many tokens of the sequence, prompt
    /// included (0: no penalty).
    pub repeat_last_n: usize,
    /// The seed of the draws: the same seed and settings give the same tokens. `None`:
    /// a seed drawn from the operating system when the chain is built
    /// ([`SamplerChain::seed`](super::SamplerChain::seed) tells which).
    pub seed: Option<u64>,
    /// Added to the logits of these token ids before anything else (`-inf` bans one;
    /// `"-inf"` in JSON).
    #[serde(with = "bias_json")]
    pub logit_bias: Vec<(u32, f32)>,
}

/// JSON of the logit bias: `[[id, bias], ...]` with a bias of `-inf` as the string
/// `"-inf"` (JSON numbers are finite).
mod bias_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Bias {
        Number(f32),
        Text(String),
    }

    pub fn serialize<S: Serializer>(v: &[(u32, f32)], s: S) -> Result<S::Ok, S::Error> {
        let pairs: Vec<(u32, Bias)> = v
            .iter()
            .map(|&(id, b)| match b.is_finite() {
                true => (id, Bias::Number(b)),
                false => (id, Bias::Text(b.to_string())),
            })
            .collect();
        pairs.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u32, f32)>, D::Error> {
        let pairs = Vec::<(u32, Bias)>::deserialize(d)?;
        pairs
            .into_iter()
            .map(|(id, b)| match b {
                Bias::Number(x) => Ok((id, x)),
                Bias::Text(t) if t == "-inf" => Ok((id, f32::NEG_INFINITY)),
                Bias::Text(t) => Err(serde::de::Error::custom(format!(
                    "logit bias of token {id}: expected a number or \"-inf\", got \"{t}\""
                ))),
            })
            .collect()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

/// The window of the penalties when nothing sets it (llama.cpp's `--repeat-last-n`).
pub const DEFAULT_REPEAT_LAST_N: usize = 64;

impl SamplingParams {
    /// Greedy decoding: the most likely token every step, no penalty.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_last_n: DEFAULT_REPEAT_LAST_N,
            seed: None,
            logit_bias: Vec::new(),
        }
    }

    /// The chat defaults when neither the user nor the model says otherwise: llama.cpp's
    /// (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) with ollama's repetition
    /// penalty of 1.1 over the last 64 tokens.
    pub fn chat() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.1,
            ..SamplingParams::greedy()
        }
    }

    /// Whether a penalty changes any logit.
    pub fn penalizes(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Checks every setting for a vocabulary of `vocab` tokens; the error names the
    /// setting ([`Error::Sampling`]).
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let finite = |param, v: f32| match v.is_finite() {
            true => Ok(()),
            false => Err(Error::sampling(param, format!("must be a number, got {v}"))),
        };
        let within = |param, v: f32, lo: f32, hi: f32| {
            finite(param, v)?;
            match (lo..=hi).contains(&v) {
                true => Ok(()),
                false => Err(Error::sampling(
                    param,
                    format!("must be in [{lo}, {hi}], got {v}"),
                )),
            }
        };
        finite("temperature", self.temperature)?;
        if self.temperature < 0.0 {
            return Err(Error::sampling(
                "temperature",
                format!("must be >= 0 (0 is greedy), got {}", self.temperature),
            ));
        }
        within("top_p", self.top_p, 0.0, 1.0)?;
        within("min_p", self.min_p, 0.0, 1.0)?;
        within("typical_p", self.typical_p, 0.0, 1.0)?;
        finite("repeat_penalty", self.repeat_penalty)?;
        if self.repeat_penalty <= 0.0 {
            return Err(Error::sampling(
                "repeat_penalty",
                format!("must be > 0 (1 is off), got {}", self.repeat_penalty),
            ));
        }
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab {
                return Err(Error::sampling(
                    "logit_bias",
                    format!("token id {id} is outside the vocabulary of {vocab} tokens"),
                ));
            }
            if bias.is_nan() || bias == f32::INFINITY {
                return Err(Error::sampling(
                    "logit_bias",
                    format!("the bias of token {id} must be a number or -inf, got {bias}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each bad value is refused with the name of its setting.
    #[test]
    fn bad_values_name_their_setting() {
        let with = |f: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::chat();
            f(&mut p);
            p
        };
        let bad: [(&str, SamplingParams); 13] = [
            ("temperature", with(|p| p.temperature = -0.1)),
            ("temperature", with(|p| p.temperature = f32::NAN)),
            ("temperature", with(|p| p.temperature = f32::INFINITY)),
            ("top_p", with(|p| p.top_p = 1.5)),
            ("top_p", with(|p| p.top_p = -0.5)),
            ("min_p", with(|p| p.min_p = 2.0)),
            ("typical_p", with(|p| p.typical_p = f32::NAN)),
            ("repeat_penalty", with(|p| p.repeat_penalty = 0.0)),
            (
                "presence_penalty",
                with(|p| p.presence_penalty = f32::INFINITY),
            ),
            (
                "frequency_penalty",
                with(|p| p.frequency_penalty = f32::NAN),
            ),
            ("logit_bias", with(|p| p.logit_bias = vec![(100, 1.0)])),
            ("logit_bias", with(|p| p.logit_bias = vec![(3, f32::NAN)])),
            (
                "logit_bias",
                with(|p| p.logit_bias = vec![(3, f32::INFINITY)]),
            ),
        ];
        for (field, p) in bad {
            match p.validate(100) {
                Err(Error::Sampling { param, msg }) => {
                    assert_eq!(param, field, "{msg}");
                    assert!(Error::sampling(param, msg).to_string().contains(field));
                }
                other => panic!("{field}: {p:?} gave {other:?}"),
            }
        }
        let ban = SamplingParams {
            logit_bias: vec![(99, f32::NEG_INFINITY), (0, 5.0)],
            ..SamplingParams::chat()
        };
        ban.validate(100).unwrap();
        SamplingParams::greedy().validate(1).unwrap();
    }

    /// JSON round trip, a banned token included; fields left out take the greedy values.
    #[test]
    fn json_round_trip() {
        let p = SamplingParams {
            seed: Some(42),
            logit_bias: vec![(3, f32::NEG_INFINITY), (7, 1.5)],
            ..SamplingParams::chat()
        };
        let text = serde_json::to_string(&p).unwrap();
        assert!(text.contains(r#"[[3,"-inf"],[7,1.5]]"#), "{text}");
        assert_eq!(serde_json::from_str::<SamplingParams>(&text).unwrap(), p);
        let q: SamplingParams = serde_json::from_str(r#"{"temperature": 0.5}"#).unwrap();
        assert_eq!(
            q,
            SamplingParams {
                temperature: 0.5,
                ..SamplingParams::greedy()
            }
        );
        assert!(serde_json::from_str::<SamplingParams>(r#"{"logit_bias": [[1, "x"]]}"#).is_err());
    }
}
