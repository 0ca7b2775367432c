//! The sampling options of `generate`, `chat` and `serve` ([`SamplingArgs`]): every
//! sampler's flag, resolved against the model's recommendation and the defaults
//! (docs/sampling.md); for `serve`, the defaults of its requests.

use std::path::Path;

use graft::models::runtime::sampling::{resolve, ModelSampling, PartialSampling, Resolved};
use graft::models::SamplingParams;
use graft::{Error, Result};

/// Sampling options of `generate`, `chat`, `batched-bench` and `serve`. Each one not
/// given comes from the model's recommendation (chats and serve) or the defaults: see
/// docs/sampling.md.
#[derive(clap::Args, Clone, Debug)]
pub(super) struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (the device's argmax).
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample only among the K most likely tokens (0: all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities sum to P (1: all).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop the tokens less than P times as likely as the most likely one (0: off).
    #[arg(long)]
    min_p: Option<f32>,
    /// Locally typical sampling with mass P (1: off).
    #[arg(long)]
    typical_p: Option<f32>,
    /// Penalize the tokens of the last --repeat-last-n tokens: positive logits divided,
    /// negative ones multiplied by this (1: off).
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Subtracted from the logit of every token seen in the window (0: off).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Subtracted from a token's logit once per time it was seen in the window (0: off).
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// The window of the penalties, in tokens (prompt included; 0: no penalty).
    #[arg(long)]
    repeat_last_n: Option<usize>,
    /// Seed of the sampler (default: drawn at random; --verbose and --json say which).
    #[arg(long)]
    seed: Option<u64>,
    /// Add BIAS to the logit of token ID, as ID+BIAS or ID-BIAS (ID-inf bans it);
    /// repeatable.
    #[arg(long, value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Print the sampling settings and where each came from (flag, model, default) once
    /// on stderr.
    #[arg(long)]
    verbose: bool,
}

/// `ID+BIAS` or `ID-BIAS` (llama.cpp's `--logit-bias` syntax).
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let at = s
        .find(['+', '-'])
        .ok_or_else(|| format!("'{s}' is not ID+BIAS or ID-BIAS (e.g. 15043+1, 2-inf)"))?;
    let id = s[..at]
        .parse::<u32>()
        .map_err(|e| format!("token id '{}': {e}", &s[..at]))?;
    let bias = s[at..]
        .parse::<f32>()
        .map_err(|e| format!("bias '{}': {e}", &s[at..]))?;
    Ok((id, bias))
}

impl SamplingArgs {
    /// The seed given with --seed, if any.
    pub(super) fn seed(&self) -> Option<u64> {
        self.seed
    }

    /// The settings these flags give, before defaults.
    fn flags(&self) -> PartialSampling {
        PartialSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
            logit_bias: self.logit_bias.clone(),
        }
    }

    /// The settings of a run: these flags, then the recommendation of the model at
    /// `model` (chats), then `base`; the seed drawn when none is given; printed once with
    /// --verbose. Checked, but for the logit-bias ids (see [`SamplingArgs::chain`]).
    pub(super) fn resolve(&self, model: Option<&Path>, base: &SamplingParams) -> Result<Resolved> {
        let recommended = match model {
            Some(path) => ModelSampling::of(path)?,
            None => ModelSampling::default(),
        };
        let mut r = resolve(&self.flags(), &recommended.settings, base);
        r.draw_seed();
        r.params.validate(usize::MAX).map_err(flag_error)?;
        if self.verbose {
            eprintln!("{}", r.describe(&recommended));
        }
        Ok(r)
    }
}

impl SamplingArgs {
    /// The settings a server's requests start from (`graft serve`): these flags over
    /// the model's recommendation `model`, each request's fields over both, the chat
    /// defaults under all. Checked against a vocabulary of `vocab` tokens (errors name
    /// the flag) and printed with --verbose; no seed is drawn (each request draws its
    /// own unless --seed gives one).
    pub(super) fn server_defaults(
        &self,
        model: &ModelSampling,
        vocab: usize,
    ) -> Result<PartialSampling> {
        let r = resolve(&self.flags(), &model.settings, &SamplingParams::chat());
        r.params.validate(vocab).map_err(flag_error)?;
        if self.verbose {
            eprintln!("{}", r.describe(model));
        }
        Ok(self.flags().or(&model.settings))
    }
}

/// A sampling error in terms of the flag that set it (`--top-p`).
pub(super) fn flag_error(e: Error) -> Error {
    match e {
        Error::Sampling { param, msg } => {
            Error::model(format!("--{}: {msg}", param.replace('_', "-")))
        }
        other => other,
    }
}
