//! Where a run's sampling settings come from: the user's flags first, then the model's
//! own recommendation (`generation_config.json` beside a Hugging Face folder's
//! config.json; the `general.sampling.*` keys llama.cpp's converter writes into a GGUF
//! file), then a base set ([`SamplingParams::chat`] for chats, greedy for plain
//! completions). [`resolve`] merges them and records each setting's [`Source`].
//!
//! From `generation_config.json`: `temperature`, `top_k`, `top_p`, `min_p`, `typical_p`,
//! `repetition_penalty` (applied over graft's window, `repeat_last_n`, where
//! transformers penalizes the whole sequence) and `do_sample`: an explicit `false` means
//! greedy, as in transformers. From GGUF: `general.sampling.temp`, `.top_k`, `.top_p`,
//! `.min_p`, `.penalty_repeat` and `.penalty_last_n` (llama.cpp's names; `-1`: the
//! whole sequence, a top-k of 0 or less: off).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::params::SamplingParams;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::models::load::gguf::{is_gguf_path, open_model_file};

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag (or a request field).
    Flag,
    /// The model's own recommendation.
    Model,
    /// The base set.
    Default,
    /// Drawn from the operating system's entropy (a seed nothing set).
    Random,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Flag => "flag",
            Source::Model => "model",
            Source::Default => "default",
            Source::Random => "random",
        })
    }
}

/// Sampling settings of which some are given (flags, or a model's recommendation); the
/// seed and the logit bias come from flags only.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PartialSampling {
    /// [`SamplingParams::temperature`].
    pub temperature: Option<f32>,
    /// [`SamplingParams::top_k`].
    pub top_k: Option<usize>,
    /// [`SamplingParams::top_p`].
    pub top_p: Option<f32>,
    /// [`SamplingParams::min_p`].
    pub min_p: Option<f32>,
    /// [`SamplingParams::typical_p`].
    pub typical_p: Option<f32>,
    /// [`SamplingParams::repeat_penalty`].
    pub repeat_penalty: Option<f32>,
    /// [`SamplingParams::presence_penalty`].
    pub presence_penalty: Option<f32>,
    /// [`SamplingParams::frequency_penalty`].
    pub frequency_penalty: Option<f32>,
    /// [`SamplingParams::repeat_last_n`].
    pub repeat_last_n: Option<usize>,
    /// [`SamplingParams::seed`].
    pub seed: Option<u64>,
    /// [`SamplingParams::logit_bias`] (empty: none).
    pub logit_bias: Vec<(u32, f32)>,
}

impl PartialSampling {
    /// These settings, and `other`'s where these give none (the logit bias: `other`'s
    /// when these have none).
    pub fn or(&self, other: &PartialSampling) -> PartialSampling {
        PartialSampling {
            temperature: self.temperature.or(other.temperature),
            top_k: self.top_k.or(other.top_k),
            top_p: self.top_p.or(other.top_p),
            min_p: self.min_p.or(other.min_p),
            typical_p: self.typical_p.or(other.typical_p),
            repeat_penalty: self.repeat_penalty.or(other.repeat_penalty),
            presence_penalty: self.presence_penalty.or(other.presence_penalty),
            frequency_penalty: self.frequency_penalty.or(other.frequency_penalty),
            repeat_last_n: self.repeat_last_n.or(other.repeat_last_n),
            seed: self.seed.or(other.seed),
            logit_bias: match self.logit_bias.is_empty() {
                true => other.logit_bias.clone(),
                false => self.logit_bias.clone(),
            },
        }
    }
}

/// A model's recommended settings and the file they were read from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelSampling {
    /// The settings the model gives (all `None` when it gives none).
    pub settings: PartialSampling,
    /// The file holding them, when the model has one.
    pub from: Option<PathBuf>,
}

/// The settings of a run and where each came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The settings.
    pub params: SamplingParams,
    /// Each setting's name ([`SamplingParams`]' field) and source, in field order.
    pub sources: Vec<(&'static str, Source)>,
}

/// `flags`, else `model`, else `base`, setting by setting.
pub fn resolve(
    flags: &PartialSampling,
    model: &PartialSampling,
    base: &SamplingParams,
) -> Resolved {
    let mut params = base.clone();
    let mut sources = Vec::new();
    macro_rules! pick {
        ($($field:ident),*) => {$(
            let (value, source) = match (flags.$field, model.$field) {
                (Some(v), _) => (v, Source::Flag),
                (None, Some(v)) => (v, Source::Model),
                (None, None) => (base.$field, Source::Default),
            };
            params.$field = value;
            sources.push((stringify!($field), source));
        )*};
    }
    pick!(
        temperature,
        top_k,
        top_p,
        min_p,
        typical_p,
        repeat_penalty,
        presence_penalty,
        frequency_penalty,
        repeat_last_n
    );
    // The base's penalties apply only when sampling: at temperature 0 a penalty that
    // nothing set is off, so that greedy decoding stays the model's own argmax.
    if params.temperature == 0.0 {
        let neutral = SamplingParams::greedy();
        for (name, source) in &sources {
            match (*name, source) {
                ("repeat_penalty", Source::Default) => {
                    params.repeat_penalty = neutral.repeat_penalty
                }
                ("presence_penalty", Source::Default) => {
                    params.presence_penalty = neutral.presence_penalty
                }
                ("frequency_penalty", Source::Default) => {
                    params.frequency_penalty = neutral.frequency_penalty
                }
                _ => {}
            }
        }
    }
    let seed = match flags.seed {
        Some(s) => (Some(s), Source::Flag),
        None => (base.seed, Source::Default),
    };
    params.seed = seed.0;
    sources.push(("seed", seed.1));
    if !flags.logit_bias.is_empty() {
        params.logit_bias = flags.logit_bias.clone();
    }
    let bias = match flags.logit_bias.is_empty() {
        true => Source::Default,
        false => Source::Flag,
    };
    sources.push(("logit_bias", bias));
    Resolved { params, sources }
}

impl Resolved {
    /// Draws the seed when nothing set one, so that it can be reported and the run
    /// repeated with it.
    pub fn draw_seed(&mut self) {
        if self.params.seed.is_none() {
            self.params.seed = Some(rand::random());
            if let Some(s) = self.sources.iter_mut().find(|s| s.0 == "seed") {
                s.1 = Source::Random;
            }
        }
    }

    /// The settings as JSON (`--json`): every field of [`SamplingParams`] and `sources`,
    /// the source of each.
    pub fn to_json(&self) -> Value {
        let mut v = serde_json::to_value(&self.params).unwrap_or(Value::Null);
        let sources: serde_json::Map<String, Value> = self
            .sources
            .iter()
            .map(|(name, src)| (name.to_string(), Value::String(src.to_string())))
            .collect();
        if let Value::Object(m) = &mut v {
            m.insert("sources".into(), Value::Object(sources));
        }
        v
    }

    /// One line for `--verbose`: every setting with its source.
    pub fn describe(&self, model: &ModelSampling) -> String {
        let p = &self.params;
        let values: [String; 11] = [
            p.temperature.to_string(),
            p.top_k.to_string(),
            p.top_p.to_string(),
            p.min_p.to_string(),
            p.typical_p.to_string(),
            p.repeat_penalty.to_string(),
            p.presence_penalty.to_string(),
            p.frequency_penalty.to_string(),
            p.repeat_last_n.to_string(),
            p.seed.map_or("from entropy".into(), |s| s.to_string()),
            match p.logit_bias.is_empty() {
                true => "none".into(),
                false => format!("{:?}", p.logit_bias),
            },
        ];
        let parts: Vec<String> = self
            .sources
            .iter()
            .zip(values)
            .map(|((name, src), v)| format!("{name} {v} ({src})"))
            .collect();
        let from = match &model.from {
            Some(path) => format!("model settings from {}", path.display()),
            None => "the model recommends no settings".into(),
        };
        format!("sampling: {}; {from}", parts.join(", "))
    }
}

impl ModelSampling {
    /// The recommendation of the model at `path`: `generation_config.json` in a folder,
    /// `general.sampling.*` in a GGUF file; none when there is neither. A value of the
    /// wrong type or out of its range is an error naming the file and the key.
    pub fn of(path: &Path) -> Result<ModelSampling> {
        if is_gguf_path(path) {
            let f = open_model_file(path)?;
            let settings = from_gguf(&f)?;
            let from = (settings != PartialSampling::default()).then(|| path.to_path_buf());
            return Ok(ModelSampling { settings, from });
        }
        let file = path.join("generation_config.json");
        if !file.is_file() {
            return Ok(ModelSampling::default());
        }
        let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
        let settings = from_generation_config(&text)
            .map_err(|e| Error::model(format!("{}: {e}", file.display())))?;
        Ok(ModelSampling {
            settings,
            from: Some(file),
        })
    }
}

/// The settings of a `generation_config.json` text (errors name the key).
pub fn from_generation_config(text: &str) -> Result<PartialSampling> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| Error::model(format!("not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| Error::model("not a JSON object"))?;
    let num = |key: &str| -> Result<Option<f64>> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::model(format!("{key}: expected a number, found {x}"))),
        }
    };
    let count = |key: &str| -> Result<Option<usize>> {
        match num(key)? {
            None => Ok(None),
            Some(x) if x >= 0.0 && x.fract() == 0.0 => Ok(Some(x as usize)),
            Some(x) => Err(Error::model(format!(
                "{key}: expected a whole number >= 0, found {x}"
            ))),
        }
    };
    let greedy = match obj.get("do_sample") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => !b,
        Some(x) => {
            return Err(Error::model(format!(
                "do_sample: expected true or false, found {x}"
            )))
        }
    };
    let s = PartialSampling {
        temperature: match greedy {
            true => Some(0.0),
            false => num("temperature")?.map(|x| x as f32),
        },
        top_k: count("top_k")?,
        top_p: num("top_p")?.map(|x| x as f32),
        min_p: num("min_p")?.map(|x| x as f32),
        typical_p: num("typical_p")?.map(|x| x as f32),
        repeat_penalty: num("repetition_penalty")?.map(|x| x as f32),
        ..PartialSampling::default()
    };
    check(&s)?;
    Ok(s)
}

/// The `general.sampling.*` settings of a GGUF file (errors name the key).
pub fn from_gguf(f: &GgufFile) -> Result<PartialSampling> {
    let md = f.metadata();
    let key = |k: &str| format!("general.sampling.{k}");
    let float = |k: &str| -> Result<Option<f32>> {
        let k = key(k);
        match md.get(&k) {
            None => Ok(None),
            Some(v) => match v.as_integer() {
                Some(i) => Ok(Some(i as f32)),
                None => md.get_f64(&k).map(|x| Some(x as f32)),
            },
        }
    };
    let int = |k: &str| -> Result<Option<i64>> {
        let k = key(k);
        match md.get(&k) {
            None => Ok(None),
            Some(_) => md.get_i64(&k).map(Some),
        }
    };
    let s = PartialSampling {
        temperature: float("temp")?,
        top_k: int("top_k")?.map(|k| k.max(0) as usize),
        top_p: float("top_p")?,
        min_p: float("min_p")?,
        repeat_penalty: float("penalty_repeat")?,
        repeat_last_n: int("penalty_last_n")?.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        ..PartialSampling::default()
    };
    check(&s).map_err(|e| Error::model(format!("{}: general.sampling.*: {e}", f.path())))?;
    Ok(s)
}

/// Checks a model's settings on their own, so that a bad one is blamed on the model.
fn check(s: &PartialSampling) -> Result<()> {
    let r = resolve(&PartialSampling::default(), s, &SamplingParams::chat());
    r.params.validate(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_model_which_beats_the_base() {
        let flags = PartialSampling {
            temperature: Some(0.3),
            seed: Some(5),
            logit_bias: vec![(2, -1.0)],
            ..PartialSampling::default()
        };
        let model = PartialSampling {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(20),
            ..PartialSampling::default()
        };
        let r = resolve(&flags, &model, &SamplingParams::chat());
        let p = &r.params;
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.3, 0.9, 20));
        assert_eq!((p.min_p, p.repeat_penalty), (0.05, 1.1));
        assert_eq!(
            (p.seed, p.logit_bias.as_slice()),
            (Some(5), &[(2, -1.0)][..])
        );
        let src = |name| r.sources.iter().find(|s| s.0 == name).unwrap().1;
        assert_eq!(src("temperature"), Source::Flag);
        assert_eq!(src("top_p"), Source::Model);
        assert_eq!(src("min_p"), Source::Default);
        assert_eq!(src("seed"), Source::Flag);
        assert_eq!(src("logit_bias"), Source::Flag);
        assert_eq!(r.sources.len(), 11);
        let line = r.describe(&ModelSampling::default());
        assert!(line.contains("temperature 0.3 (flag)"), "{line}");
        assert!(line.contains("top_p 0.9 (model)"), "{line}");
        assert!(line.contains("min_p 0.05 (default)"), "{line}");
        let json = r.to_json();
        assert_eq!(json["top_k"], 20);
        assert_eq!(json["seed"], 5);
        assert_eq!(json["sources"]["top_p"], "model");
        assert_eq!(json["sources"]["repeat_last_n"], "default");
        // temperature 0 from a flag or the model: the base's penalty is off (greedy is
        // the argmax), one given stays
        let greedy = PartialSampling {
            temperature: Some(0.0),
            ..PartialSampling::default()
        };
        let r = resolve(
            &greedy,
            &PartialSampling::default(),
            &SamplingParams::chat(),
        );
        assert_eq!((r.params.temperature, r.params.repeat_penalty), (0.0, 1.0));
        let model = PartialSampling {
            temperature: Some(0.0),
            ..PartialSampling::default()
        };
        let r = resolve(&PartialSampling::default(), &model, &SamplingParams::chat());
        assert_eq!(r.params.repeat_penalty, 1.0);
        let penalized = PartialSampling {
            repeat_penalty: Some(1.3),
            ..greedy
        };
        let r = resolve(
            &penalized,
            &PartialSampling::default(),
            &SamplingParams::chat(),
        );
        assert_eq!(r.params.repeat_penalty, 1.3);
        // nothing given: the base, all default
        let r = resolve(
            &PartialSampling::default(),
            &PartialSampling::default(),
            &SamplingParams::greedy(),
        );
        assert_eq!(r.params, SamplingParams::greedy());
        assert!(r.sources.iter().all(|s| s.1 == Source::Default));
    }

    #[test]
    fn or_fills_in_what_is_missing() {
        let mine = PartialSampling {
            temperature: Some(0.2),
            logit_bias: vec![(1, -1.0)],
            ..PartialSampling::default()
        };
        let other = PartialSampling {
            temperature: Some(0.9),
            top_k: Some(7),
            seed: Some(3),
            logit_bias: vec![(2, 1.0)],
            ..PartialSampling::default()
        };
        let both = mine.or(&other);
        assert_eq!(
            (both.temperature, both.top_k, both.seed),
            (Some(0.2), Some(7), Some(3))
        );
        assert_eq!(both.logit_bias, vec![(1, -1.0)]);
        assert_eq!(both.top_p, None);
        assert_eq!(PartialSampling::default().or(&other), other);
    }

    #[test]
    fn generation_config_fields() {
        let s = from_generation_config(
            r#"{"do_sample": true, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
               "repetition_penalty": 1.05, "bos_token_id": 1, "min_p": null}"#,
        )
        .unwrap();
        assert_eq!(s.temperature, Some(0.7));
        assert_eq!(
            (s.top_k, s.top_p, s.repeat_penalty),
            (Some(20), Some(0.8), Some(1.05))
        );
        assert_eq!((s.min_p, s.typical_p), (None, None));
        // do_sample false: greedy, whatever the temperature says
        let s = from_generation_config(r#"{"do_sample": false, "temperature": 0.6}"#).unwrap();
        assert_eq!(s.temperature, Some(0.0));
        // no do_sample: the values as given
        let s = from_generation_config(r#"{"temperature": 0.6}"#).unwrap();
        assert_eq!(s.temperature, Some(0.6));
        assert_eq!(
            from_generation_config("{}").unwrap(),
            PartialSampling::default()
        );
        for (bad, key) in [
            (r#"{"top_k": 2.5}"#, "top_k"),
            (r#"{"top_k": -1}"#, "top_k"),
            (r#"{"top_p": "high"}"#, "top_p"),
            (r#"{"do_sample": 1}"#, "do_sample"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"temperature": -1}"#, "temperature"),
        ] {
            let e = from_generation_config(bad).unwrap_err().to_string();
            assert!(e.contains(key), "{bad}: {e}");
        }
        assert!(from_generation_config("[1]").is_err());
    }

    /// A GGUF file with llama.cpp's keys, in the types its converter writes (and others).
    #[test]
    fn gguf_general_sampling_keys() {
        use crate::gguf::{GgufWriter, Value};
        let file = |pairs: Vec<(&str, Value)>| {
            let mut w = GgufWriter::new();
            for (k, v) in pairs {
                w.metadata_mut().insert(format!("general.sampling.{k}"), v);
            }
            GgufFile::from_bytes("t.gguf", w.to_bytes().unwrap()).unwrap()
        };
        let f = file(vec![
            ("temp", Value::F32(0.6)),
            ("top_k", Value::I32(20)),
            ("top_p", Value::F64(0.95)),
            ("min_p", Value::U32(0)),
            ("penalty_repeat", Value::F32(1.05)),
            ("penalty_last_n", Value::I32(-1)),
            ("mirostat", Value::I32(0)),
        ]);
        let s = from_gguf(&f).unwrap();
        assert_eq!(s.temperature, Some(0.6));
        assert_eq!(
            (s.top_k, s.top_p, s.min_p),
            (Some(20), Some(0.95), Some(0.0))
        );
        assert_eq!(
            (s.repeat_penalty, s.repeat_last_n),
            (Some(1.05), Some(usize::MAX))
        );
        assert_eq!(
            from_gguf(&file(vec![("top_k", Value::I32(-1))]))
                .unwrap()
                .top_k,
            Some(0)
        );
        assert_eq!(
            from_gguf(&file(vec![])).unwrap(),
            PartialSampling::default()
        );
        for (k, v) in [
            ("temp", Value::String("hot".into())),
            ("top_k", Value::F32(2.0)),
            ("top_p", Value::F32(3.0)),
        ] {
            let e = from_gguf(&file(vec![(k, v)])).unwrap_err().to_string();
            assert!(e.contains(k), "{e}");
        }
    }
}
