//! Model hyper-parameters, read from and written to a Hugging Face `config.json`.
//!
//! Three Hugging Face families share one decoder here (see `model.rs`), told apart by
//! `model_type` (and `architectures`):
//! - `qwen3` (`Qwen3ForCausalLM`): per-head RMSNorm on q and k; biases on q/k/v/o only if
//!   `attention_bias`.
//! - `qwen2` (`Qwen2ForCausalLM`): no q/k norm; q/k/v always have a bias, o never.
//! - `llama` (`LlamaForCausalLM`): no q/k norm; biases on q/k/v/o if `attention_bias`, on the
//!   MLP if `mlp_bias`.
//!
//! Field names follow Hugging Face's configs so that a checkpoint directory written here
//! loads in `transformers` and a real checkpoint loads here. Loading goes field by field
//! (instead of one `serde_json::from_str`) so that a bad value is reported with the name of
//! the field, which serde's own messages do not carry.
//!
//! Over 800 lines because its tests (220 lines, one per family and malformed field) sit
//! beside the parser they check.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::PolicyError;

/// The model families this crate implements: (`model_type`, architecture class name).
pub const SUPPORTED_MODELS: [(&str, &str); 3] = [
    ("qwen3", "Qwen3ForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("llama", "LlamaForCausalLM"),
];

/// Which Hugging Face family a config describes; decides the family's fixed details.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3,
    Qwen2,
    Llama,
}

impl Family {
    fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "qwen3" => Some(Family::Qwen3),
            "qwen2" => Some(Family::Qwen2),
            "llama" => Some(Family::Llama),
            _ => None,
        }
    }
}

/// RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters` with a
/// `rope_type` other than "default"), computed as `transformers`' `modeling_rope_utils`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear { factor: f64 },
    /// YaRN: interpolation for low frequencies, extrapolation for high ones, with a linear
    /// ramp between, and cos/sin scaled by an attention factor.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta_fast: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta_slow: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale_all_dim: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        truncate: Option<bool>,
    },
    /// Llama 3.1's smooth frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// Architecture of the decoder (see `model.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architectures: Vec<String>,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `None` = plain RoPE. Written as Hugging Face's `rope_scaling`, which both
    /// `transformers` 4 and 5 read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the attention projections (q/k/v/o for qwen3 and llama; qwen2 always has
    /// q/k/v biases and never an o bias, whatever this says).
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections (llama only).
    #[serde(default)]
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub torch_dtype: String,
}

impl ModelConfig {
    /// A CPU-sized model for tests and toy runs.
    pub fn tiny(vocab_size: usize) -> Self {
        ModelConfig {
            architectures: vec!["Qwen3ForCausalLM".to_string()],
            model_type: "qwen3".to_string(),
            vocab_size,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: None,
            eos_token_id: None,
            torch_dtype: "float32".to_string(),
        }
    }

    /// Reads a Hugging Face `config.json`. Fields this crate does not use are ignored;
    /// optional fields get the defaults of the family's Hugging Face config class.
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|e| PolicyError::io(path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| PolicyError::ConfigSyntax {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let Value::Object(obj) = value else {
            return Err(PolicyError::ConfigSyntax {
                path: path.to_path_buf(),
                message: "the top level is not a JSON object".to_string(),
            });
        };
        let f = Fields { path, obj: &obj };

        let supported = SUPPORTED_MODELS
            .iter()
            .map(|(t, a)| format!("\"{t}\" ({a})"))
            .collect::<Vec<_>>()
            .join(", ");
        let model_type: String = f.get_or("model_type", "qwen3".to_string())?;
        let Some(family) = Family::from_model_type(&model_type) else {
            return Err(f.err(
                "model_type",
                format!("is \"{model_type}\", but only {supported} are implemented"),
            ));
        };
        let architecture = SUPPORTED_MODELS
            .iter()
            .find(|(t, _)| *t == model_type)
            .map(|(_, a)| a.to_string())
            .expect("every Family is in SUPPORTED_MODELS");
        let architectures: Vec<String> = f.get_or("architectures", vec![architecture.clone()])?;
        if let Some(other) = architectures.iter().find(|a| **a != architecture) {
            return Err(f.err(
                "architectures",
                format!(
                    "contains \"{other}\", but model_type \"{model_type}\" is implemented only as \
                     \"{architecture}\" (supported: {supported})"
                ),
            ));
        }

        // Features of the Hugging Face families that this implementation does not have:
        // refuse them rather than silently computing something else.
        if let Some(Value::Array(types)) = obj.get("layer_types") {
            if let Some(t) = types.iter().find(|t| *t != "full_attention") {
                return Err(f.err(
                    "layer_types",
                    format!("contains {t}, but only \"full_attention\" is implemented"),
                ));
            }
        }
        if obj.get("use_sliding_window") == Some(&Value::Bool(true)) {
            return Err(f.err(
                "use_sliding_window",
                "is true, but sliding-window attention is not implemented",
            ));
        }
        if let Some(act) = obj.get("hidden_act") {
            if act != "silu" {
                return Err(f.err(
                    "hidden_act",
                    format!("is {act}, but only \"silu\" is implemented"),
                ));
            }
        }

        let hidden_size: usize = f.get("hidden_size")?;
        let num_attention_heads: usize = f.get("num_attention_heads")?;
        let max_position_embeddings: usize = f.get_or(
            "max_position_embeddings",
            match family {
                Family::Llama => 2048,
                Family::Qwen2 | Family::Qwen3 => 32768,
            },
        )?;
        // `transformers` 5 writes `rope_parameters` (with `rope_theta` inside), older versions
        // `rope_theta` and `rope_scaling` at the top level.
        let (rope_field, rope) = match obj.get("rope_parameters") {
            Some(Value::Null) | None => ("rope_scaling", obj.get("rope_scaling")),
            some => ("rope_parameters", some),
        };
        let rope_theta = match rope.and_then(|r| r.get("rope_theta")) {
            Some(v) => f.parse(&format!("{rope_field}.rope_theta"), v)?,
            None => f.get_or("rope_theta", 10000.0)?,
        };
        let rope_scaling = f.rope_scaling(rope_field, rope, max_position_embeddings)?;
        if let Some(v) = obj.get("partial_rotary_factor") {
            let p: f64 = f.parse("partial_rotary_factor", v)?;
            if p != 1.0 {
                return Err(f.err(
                    "partial_rotary_factor",
                    format!("is {p}, but only rotation of the whole head (1.0) is implemented"),
                ));
            }
        }

        let config = ModelConfig {
            architectures,
            model_type,
            vocab_size: f.get("vocab_size")?,
            hidden_size,
            intermediate_size: f.get("intermediate_size")?,
            num_hidden_layers: f.get("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: f.get_or("num_key_value_heads", num_attention_heads)?,
            // Qwen3Config defaults head_dim to 128; the others derive it.
            head_dim: f.get_or(
                "head_dim",
                match family {
                    Family::Qwen3 => 128,
                    Family::Qwen2 | Family::Llama => hidden_size / num_attention_heads.max(1),
                },
            )?,
            rms_norm_eps: f.get_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: f.get_or("tie_word_embeddings", false)?,
            // Qwen2Config has no such field (its q/k/v biases are fixed), so it is not read.
            attention_bias: match family {
                Family::Qwen2 => false,
                Family::Qwen3 | Family::Llama => f.get_or("attention_bias", false)?,
            },
            mlp_bias: match family {
                Family::Llama => f.get_or("mlp_bias", false)?,
                Family::Qwen2 | Family::Qwen3 => false,
            },
            bos_token_id: f.token_id("bos_token_id")?,
            eos_token_id: f.token_id("eos_token_id")?,
            // Newer `transformers` write `dtype`, older ones `torch_dtype`.
            torch_dtype: match f.get_or::<Option<String>>("torch_dtype", None)? {
                Some(d) => d,
                None => f.get_or("dtype", "float32".to_string())?,
            },
        };
        config
            .validate()
            .map_err(|(field, message)| f.err(field, message))?;
        Ok(config)
    }

    /// The family `model_type` names. Panics on an unknown one, which `validate` (run by
    /// `load`, `save` and `Policy::new`) refuses first.
    pub fn family(&self) -> Family {
        Family::from_model_type(&self.model_type)
            .unwrap_or_else(|| panic!("unsupported model_type \"{}\"", self.model_type))
    }

    /// Whether q and k get a per-head RMSNorm (`q_norm`, `k_norm`): Qwen3 only.
    pub fn qk_norm(&self) -> bool {
        self.family() == Family::Qwen3
    }

    /// Whether q/k/v projections have biases.
    pub fn qkv_bias(&self) -> bool {
        self.family() == Family::Qwen2 || self.attention_bias
    }

    /// Whether the attention output projection has a bias.
    pub fn o_bias(&self) -> bool {
        self.family() != Family::Qwen2 && self.attention_bias
    }

    /// Whether the MLP projections have biases.
    pub fn mlp_has_bias(&self) -> bool {
        self.family() == Family::Llama && self.mlp_bias
    }

    /// Writes `config.json` (pretty-printed).
    pub fn save(&self, path: &Path) -> Result<(), PolicyError> {
        self.validate().map_err(|(field, message)| {
            PolicyError::InvalidConfig(format!("field `{field}` {message}"))
        })?;
        let mut text = serde_json::to_string_pretty(self).expect("ModelConfig serializes to JSON");
        text.push('\n');
        std::fs::write(path, text).map_err(|e| PolicyError::io(path, e))
    }

    /// Number of scalar parameters of the model this config describes (the count of what
    /// `save_weights` writes).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut attention = h * q + 2 * h * kv + q * h;
        if self.qk_norm() {
            attention += 2 * self.head_dim;
        }
        if self.qkv_bias() {
            attention += q + 2 * kv;
        }
        if self.o_bias() {
            attention += h;
        }
        let mut mlp = 3 * h * self.intermediate_size;
        if self.mlp_has_bias() {
            mlp += 2 * self.intermediate_size + h;
        }
        let layer = attention + mlp + 2 * h;
        let embed = self.vocab_size * h;
        let lm_head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        embed + self.num_hidden_layers * layer + h + lm_head
    }

    /// Checks the relations between fields that the model relies on; returns the offending
    /// field and what is wrong with it.
    pub(crate) fn validate(&self) -> Result<(), (&'static str, String)> {
        let Some(&(_, architecture)) = SUPPORTED_MODELS.iter().find(|(t, _)| *t == self.model_type)
        else {
            return Err((
                "model_type",
                format!(
                    "is \"{}\", but only {:?} are implemented",
                    self.model_type,
                    SUPPORTED_MODELS.map(|(t, _)| t)
                ),
            ));
        };
        if let Some(other) = self.architectures.iter().find(|a| *a != architecture) {
            return Err((
                "architectures",
                format!(
                    "contains \"{other}\", but model_type \"{}\" is implemented as \"{architecture}\"",
                    self.model_type
                ),
            ));
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err((field, "must be positive".to_string()));
            }
        }
        if (self.num_attention_heads / self.num_key_value_heads) * self.num_key_value_heads
            != self.num_attention_heads
        {
            return Err((
                "num_key_value_heads",
                format!(
                    "({}) must divide num_attention_heads ({})",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.head_dim & 1 == 1 {
            return Err((
                "head_dim",
                format!("({}) must be even for RoPE", self.head_dim),
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(("rms_norm_eps", "must be positive".to_string()));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err(("rope_theta", "must be positive".to_string()));
        }
        let factor = match &self.rope_scaling {
            None => None,
            Some(RopeScaling::Linear { factor }) => Some(*factor),
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            })
            | Some(RopeScaling::Llama3 {
                factor,
                original_max_position_embeddings,
                ..
            }) => {
                if *original_max_position_embeddings == 0 {
                    return Err((
                        "rope_scaling",
                        "has original_max_position_embeddings 0; it must be positive".to_string(),
                    ));
                }
                Some(*factor)
            }
        };
        if let Some(factor) = factor {
            if factor.is_nan() || factor <= 0.0 {
                return Err((
                    "rope_scaling",
                    format!("has factor {factor}; it must be positive"),
                ));
            }
        }
        if let Some(RopeScaling::Llama3 {
            low_freq_factor,
            high_freq_factor,
            ..
        }) = &self.rope_scaling
        {
            if low_freq_factor == high_freq_factor || *low_freq_factor <= 0.0 {
                return Err((
                    "rope_scaling",
                    format!(
                        "has low_freq_factor {low_freq_factor} and high_freq_factor \
                         {high_freq_factor}; they must be positive and differ"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Field-by-field access to a parsed config.json, with errors that name the field.
struct Fields<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> PolicyError {
        PolicyError::ConfigField {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    fn parse<T: DeserializeOwned>(&self, field: &str, v: &Value) -> Result<T, PolicyError> {
        T::deserialize(v).map_err(|e| self.err(field, format!("has an invalid value {v}: {e}")))
    }

    fn get<T: DeserializeOwned>(&self, field: &str) -> Result<T, PolicyError> {
        match self.obj.get(field) {
            Some(v) => self.parse(field, v),
            None => Err(self.err(field, "is missing")),
        }
    }

    fn get_or<T: DeserializeOwned>(&self, field: &str, default: T) -> Result<T, PolicyError> {
        match self.obj.get(field) {
            Some(Value::Null) | None => Ok(default),
            Some(v) => self.parse(field, v),
        }
    }

    /// Parses the RoPE scaling dict found under `field` (`rope_parameters` or
    /// `rope_scaling`); `None` for plain RoPE. Follows `transformers`' defaults: `type` is the
    /// old name of `rope_type`; YaRN and Llama 3 take `original_max_position_embeddings` from
    /// `max_position_embeddings` when it is absent.
    fn rope_scaling(
        &self,
        field: &str,
        rope: Option<&Value>,
        max_position_embeddings: usize,
    ) -> Result<Option<RopeScaling>, PolicyError> {
        let rope = match rope {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(map)) => map,
            Some(v) => return Err(self.err(field, format!("is {v}, expected a JSON object"))),
        };
        let key = |name: &str| format!("{field}.{name}");
        let get = |name: &str| rope.get(name).filter(|v| !v.is_null());
        let rope_type: String = match get("rope_type").or_else(|| get("type")) {
            Some(v) => self.parse(&key("rope_type"), v)?,
            None => "default".to_string(),
        };
        let required = |name: &str| -> Result<f64, PolicyError> {
            match get(name) {
                Some(v) => self.parse(&key(name), v),
                None => Err(self.err(
                    &key(name),
                    format!("is missing (required for rope_type \"{rope_type}\")"),
                )),
            }
        };
        let optional = |name: &str| -> Result<Option<f64>, PolicyError> {
            get(name).map(|v| self.parse(&key(name), v)).transpose()
        };
        let original_max = || -> Result<usize, PolicyError> {
            match get("original_max_position_embeddings") {
                Some(v) => self.parse(&key("original_max_position_embeddings"), v),
                None => Ok(max_position_embeddings),
            }
        };
        Ok(match rope_type.as_str() {
            "default" => None,
            "linear" => Some(RopeScaling::Linear {
                factor: required("factor")?,
            }),
            "yarn" => {
                let original_max_position_embeddings = original_max()?;
                Some(RopeScaling::Yarn {
                    factor: match optional("factor")? {
                        Some(f) => f,
                        None => {
                            max_position_embeddings as f64 / original_max_position_embeddings as f64
                        }
                    },
                    original_max_position_embeddings,
                    attention_factor: optional("attention_factor")?,
                    beta_fast: optional("beta_fast")?,
                    beta_slow: optional("beta_slow")?,
                    mscale: optional("mscale")?,
                    mscale_all_dim: optional("mscale_all_dim")?,
                    truncate: get("truncate")
                        .map(|v| self.parse(&key("truncate"), v))
                        .transpose()?,
                })
            }
            "llama3" => Some(RopeScaling::Llama3 {
                factor: required("factor")?,
                low_freq_factor: required("low_freq_factor")?,
                high_freq_factor: required("high_freq_factor")?,
                original_max_position_embeddings: original_max()?,
            }),
            other => {
                return Err(self.err(
                    &key("rope_type"),
                    format!(
                        "is \"{other}\", but only \"default\", \"linear\", \"yarn\" and \"llama3\" \
                         RoPE are implemented"
                    ),
                ))
            }
        })
    }

    /// Hugging Face allows a list of ids for `eos_token_id`; the first one is the primary.
    fn token_id(&self, field: &str) -> Result<Option<u32>, PolicyError> {
        match self.obj.get(field) {
            Some(Value::Array(ids)) => match ids.first() {
                Some(v) => self.parse(field, v).map(Some),
                None => Ok(None),
            },
            Some(Value::Null) | None => Ok(None),
            Some(v) => self.parse(field, v).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let mut config = ModelConfig::tiny(300);
        config.eos_token_id = Some(2);
        config.save(&path).unwrap();
        assert_eq!(ModelConfig::load(&path).unwrap(), config);
    }

    #[test]
    fn loads_hugging_face_qwen3_config() {
        // Abridged from Qwen/Qwen3-0.6B's config.json.
        let text = r#"{
          "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
          "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
          "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
          "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
          "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
          "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
          "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
          "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
          "vocab_size": 151936
        }"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, text).unwrap();
        let c = ModelConfig::load(&path).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_id, Some(151645));
        assert_eq!(c.torch_dtype, "bfloat16");
        // Qwen3-0.6B has 596M parameters with tied embeddings.
        assert_eq!(c.num_parameters(), 596_049_920);
    }

    #[test]
    fn load_error_names_the_field_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let mut v = serde_json::to_value(ModelConfig::tiny(300)).unwrap();
        v["hidden_size"] = Value::String("wide".into());
        std::fs::write(&path, v.to_string()).unwrap();
        let msg = ModelConfig::load(&path).unwrap_err().to_string();
        assert!(msg.contains("hidden_size"), "{msg}");
        assert!(msg.contains("config.json"), "{msg}");

        v["hidden_size"] = Value::from(128);
        v.as_object_mut().unwrap().remove("vocab_size");
        std::fs::write(&path, v.to_string()).unwrap();
        let msg = ModelConfig::load(&path).unwrap_err().to_string();
        assert!(
            msg.contains("vocab_size") && msg.contains("missing"),
            "{msg}"
        );

        std::fs::write(&path, "{ not json").unwrap();
        let msg = ModelConfig::load(&path).unwrap_err().to_string();
        assert!(msg.contains("not valid JSON"), "{msg}");

        let msg = ModelConfig::load(&dir.path().join("absent.json"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("absent.json"), "{msg}");
    }

    #[test]
    fn load_rejects_inconsistent_heads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let mut v = serde_json::to_value(ModelConfig::tiny(300)).unwrap();
        v["num_key_value_heads"] = Value::from(3);
        std::fs::write(&path, v.to_string()).unwrap();
        let msg = ModelConfig::load(&path).unwrap_err().to_string();
        assert!(msg.contains("num_key_value_heads"), "{msg}");
    }

    fn load_json(v: &Value) -> Result<ModelConfig, PolicyError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, v.to_string()).unwrap();
        ModelConfig::load(&path)
    }

    #[test]
    fn unknown_architecture_and_model_type_name_file_and_field() {
        let mut v = serde_json::to_value(ModelConfig::tiny(300)).unwrap();
        v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        let msg = load_json(&v).unwrap_err().to_string();
        assert!(
            msg.contains("config.json") && msg.contains("`architectures`"),
            "{msg}"
        );
        assert!(msg.contains("MistralForCausalLM"), "{msg}");

        // A supported architecture under another family's model_type is refused too.
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        let msg = load_json(&v).unwrap_err().to_string();
        assert!(msg.contains("`architectures`"), "{msg}");

        v["model_type"] = "mistral".into();
        let msg = load_json(&v).unwrap_err().to_string();
        assert!(
            msg.contains("config.json") && msg.contains("`model_type`") && msg.contains("mistral"),
            "{msg}"
        );
    }

    #[test]
    fn unsupported_rope_types_and_features_name_the_field() {
        let base = serde_json::to_value(ModelConfig::tiny(300)).unwrap();
        let cases = [
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "dynamic", "factor": 2.0}),
                "rope_scaling.rope_type",
            ),
            (
                "rope_parameters",
                serde_json::json!({"rope_type": "longrope", "rope_theta": 1e4}),
                "rope_parameters.rope_type",
            ),
            (
                "rope_scaling",
                serde_json::json!({"type": "linear"}),
                "rope_scaling.factor",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
                "rope_scaling.low_freq_factor",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "linear", "factor": "big"}),
                "rope_scaling.factor",
            ),
            (
                "partial_rotary_factor",
                serde_json::json!(0.5),
                "partial_rotary_factor",
            ),
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ];
        for (field, value, named) in cases {
            let mut v = base.clone();
            v[field] = value;
            let msg = load_json(&v).unwrap_err().to_string();
            assert!(
                msg.contains("config.json") && msg.contains(&format!("`{named}`")),
                "{field}: {msg}"
            );
        }
    }

    #[test]
    fn rope_scaling_defaults_and_round_trip() {
        let mut v = serde_json::to_value(ModelConfig::tiny(300)).unwrap();
        // transformers 5 layout, YaRN without original_max_position_embeddings.
        v["rope_parameters"] =
            serde_json::json!({"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0});
        let c = load_json(&v).unwrap();
        assert_eq!(c.rope_theta, 5e5);
        assert_eq!(
            c.rope_scaling,
            Some(RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 4096,
                attention_factor: None,
                beta_fast: None,
                beta_slow: None,
                mscale: None,
                mscale_all_dim: None,
                truncate: None,
            })
        );
        // Saved as top-level rope_theta + rope_scaling, read back the same.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        c.save(&path).unwrap();
        let saved: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(saved["rope_scaling"]["rope_type"], "yarn");
        assert_eq!(ModelConfig::load(&path).unwrap(), c);
        // "default" is plain RoPE.
        v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e4});
        assert_eq!(load_json(&v).unwrap().rope_scaling, None);
    }

    #[test]
    fn family_defaults_and_biases() {
        let llama = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "attention_bias": true, "mlp_bias": true
        });
        let c = load_json(&llama).unwrap();
        assert_eq!(
            c.head_dim, 16,
            "llama derives head_dim from hidden_size / heads"
        );
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.max_position_embeddings, 2048);
        assert!(!c.qk_norm() && c.qkv_bias() && c.o_bias() && c.mlp_has_bias());

        let mut qwen2 = llama.clone();
        qwen2["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        qwen2["model_type"] = "qwen2".into();
        let c = load_json(&qwen2).unwrap();
        assert_eq!(c.head_dim, 16);
        // Qwen2's biases are fixed: q/k/v always, o and MLP never.
        assert!(!c.qk_norm() && c.qkv_bias() && !c.o_bias() && !c.mlp_has_bias());

        let mut qwen3 = llama;
        qwen3["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
        qwen3["model_type"] = "qwen3".into();
        let c = load_json(&qwen3).unwrap();
        assert_eq!(c.head_dim, 128, "Qwen3Config's default head_dim");
        assert!(c.qk_norm() && c.qkv_bias() && c.o_bias() && !c.mlp_has_bias());
    }
}
