//! Model hyper-parameters, read from and written to a Hugging Face `config.json`.
//!
//! Field names follow Hugging Face's `Qwen3Config` so that a checkpoint directory written
//! here loads in `transformers` and a real Qwen3 checkpoint loads here. Loading goes field
//! by field (instead of one `serde_json::from_str`) so that a bad value is reported with
//! the name of the field, which serde's own messages do not carry.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::PolicyError;

/// Architecture of a Qwen3-style decoder (see `model.rs`).
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
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
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
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            bos_token_id: None,
            eos_token_id: None,
            torch_dtype: "float32".to_string(),
        }
    }

    /// Reads a Hugging Face `config.json`. Fields this crate does not use are ignored;
    /// optional fields get Hugging Face's `Qwen3Config` defaults.
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

        let model_type: String = f.get_or("model_type", "qwen3".to_string())?;
        if model_type != "qwen3" {
            return Err(f.err(
                "model_type",
                format!(
                    "is \"{model_type}\", but only \"qwen3\" (Qwen3ForCausalLM) is implemented"
                ),
            ));
        }
        // Features of the Hugging Face family that this implementation does not have: refuse
        // them rather than silently computing something else.
        for field in ["rope_scaling", "rope_parameters"] {
            match obj.get(field).and_then(|v| v.get("rope_type")) {
                None | Some(Value::Null) => {}
                Some(t) if t == "default" => {}
                Some(t) => {
                    return Err(f.err(
                        field,
                        format!(
                            "has rope_type {t}, but only plain RoPE (\"default\") is implemented"
                        ),
                    ))
                }
            }
        }
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
        if obj.get("attention_bias") == Some(&Value::Bool(true)) {
            return Err(f.err(
                "attention_bias",
                "is true, but attention projections here have no bias",
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
        let config = ModelConfig {
            architectures: f.get_or("architectures", vec!["Qwen3ForCausalLM".to_string()])?,
            model_type,
            vocab_size: f.get("vocab_size")?,
            hidden_size,
            intermediate_size: f.get("intermediate_size")?,
            num_hidden_layers: f.get("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: f.get_or("num_key_value_heads", num_attention_heads)?,
            head_dim: f.get_or("head_dim", hidden_size / num_attention_heads.max(1))?,
            rms_norm_eps: f.get_or("rms_norm_eps", 1e-6)?,
            // `transformers` 5 moved it into `rope_parameters`.
            rope_theta: match obj.get("rope_parameters").and_then(|r| r.get("rope_theta")) {
                Some(v) => f.parse("rope_parameters.rope_theta", v)?,
                None => f.get_or("rope_theta", 10000.0)?,
            },
            max_position_embeddings: f.get_or("max_position_embeddings", 32768)?,
            tie_word_embeddings: f.get_or("tie_word_embeddings", false)?,
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
        let attention = h * q + 2 * h * kv + q * h + 2 * self.head_dim;
        let mlp = 3 * h * self.intermediate_size;
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
}
