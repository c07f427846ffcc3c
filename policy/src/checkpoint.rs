//! Saving and loading weights as Hugging Face safetensors checkpoints.
//!
//! A checkpoint directory is `config.json` + `model.safetensors` (or, for large Hugging
//! Face checkpoints, shards listed in `model.safetensors.index.json`). The files are
//! memory-mapped, not read whole. Loading checks every tensor's presence, shape and dtype
//! before copying any, so a failed load leaves the model as it was. Values are converted to the var store's dtype and device on copy, so a bfloat16
//! checkpoint loads into float32 training weights.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};
use tch::{Device, Tensor};

use crate::{ModelConfig, Policy, PolicyError};

const CONFIG_FILE: &str = "config.json";
const WEIGHTS_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Files a Hugging Face model directory may carry besides config.json, tokenizer.json and
/// the weights: the chat format and special tokens, copied as they are wherever a model
/// directory is written (exports, staged versions).
pub const HF_EXTRAS: [&str; 5] = [
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
];

impl Policy {
    /// Writes all parameters to one safetensors file under their Hugging Face names.
    pub fn save_weights(&self, path: &Path) -> Result<(), PolicyError> {
        let vars = self.vs.variables();
        self.save_weights_with(path, vars.iter().map(|(n, t)| (n.as_str(), t)))
    }

    /// [`Policy::save_weights`] with `weights` (every parameter, by name) written instead
    /// of the model's own: for a trainer that keeps the current weights elsewhere (on the
    /// host) while the model's are released (the learner's `shard = "full"`).
    pub fn save_weights_with<'a>(
        &self,
        path: &Path,
        weights: impl Iterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<(), PolicyError> {
        let mut named: Vec<(String, Tensor)> = weights
            // The safetensors writer copies raw bytes: make sure they are host-side and dense.
            .map(|(name, t)| {
                (
                    name.to_string(),
                    t.detach().to_device(Device::Cpu).contiguous(),
                )
            })
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| PolicyError::io(dir, e))?;
        }
        Tensor::write_safetensors(&named, path).map_err(|e| PolicyError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Loads parameters from one safetensors file. Every parameter must be present with the
    /// right shape; extra tensors (e.g. `lm_head.weight` in a tied checkpoint) are ignored.
    pub fn load_weights(&mut self, path: &Path) -> Result<(), PolicyError> {
        self.load_weight_files(&[path.to_path_buf()])
    }

    /// Loads parameters from `path`: a safetensors file, or a Hugging Face checkpoint
    /// directory (`model.safetensors` or the shards its index names). The directory's
    /// config.json is not read: every tensor's shape is checked against this model.
    pub fn load_path(&mut self, path: &Path) -> Result<(), PolicyError> {
        if path.is_dir() {
            let files = weight_files(path)?;
            self.load_weight_files(&files)
        } else {
            self.load_weights(path)
        }
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if needed).
    pub fn save_dir(&self, dir: &Path) -> Result<(), PolicyError> {
        let vars = self.vs.variables();
        self.save_dir_with(dir, vars.iter().map(|(n, t)| (n.as_str(), t)))
    }

    /// [`Policy::save_dir`] with `weights` written instead of the model's own (see
    /// [`Policy::save_weights_with`]).
    pub fn save_dir_with<'a>(
        &self,
        dir: &Path,
        weights: impl Iterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<(), PolicyError> {
        std::fs::create_dir_all(dir).map_err(|e| PolicyError::io(dir, e))?;
        // Record the dtype the weights are actually stored in, which Hugging Face reads.
        let mut config = self.config.clone();
        config.torch_dtype = dtype_name(self.model.compute_kind()).to_string();
        config.save(&dir.join(CONFIG_FILE))?;
        self.save_weights_with(&dir.join(WEIGHTS_FILE), weights)
    }

    /// Loads a Hugging Face checkpoint directory: `config.json` plus `model.safetensors` or
    /// the shards named by `model.safetensors.index.json`. Weights are float32 whatever the
    /// checkpoint's dtype; cast with `var_store_mut()` for half-precision inference.
    pub fn load_dir(dir: &Path, device: Device) -> Result<Self, PolicyError> {
        let config = ModelConfig::load(&dir.join(CONFIG_FILE))?;
        let files = weight_files(dir)?;
        let mut policy = Policy::zeroed(config, device);
        policy.load_weight_files(&files)?;
        Ok(policy)
    }

    /// Loads the parameters from `files` (one checkpoint's safetensors files). Each file is
    /// memory-mapped and only its header parsed up front; every parameter is checked
    /// (present, same shape, a float type) before any is copied; then each tensor's bytes
    /// are read, converted and copied into the model one at a time. So a load needs the
    /// model's memory plus one tensor, not the checkpoint's size on top.
    fn load_weight_files(&mut self, files: &[PathBuf]) -> Result<(), PolicyError> {
        let mut maps = Vec::with_capacity(files.len());
        for file in files {
            let f = std::fs::File::open(file).map_err(|e| PolicyError::io(file, e))?;
            // SAFETY: the map is read-only and lives only for this load; a checkpoint
            // rewritten in place by another process during the load is not supported
            // (Tutor writes checkpoints to a temporary directory and renames it).
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| PolicyError::io(file, e))?;
            maps.push((file.clone(), map));
        }
        let buffers: Vec<(PathBuf, &[u8])> =
            maps.iter().map(|(f, m)| (f.clone(), &m[..])).collect();
        self.load_weight_buffers(&buffers)
    }

    /// Loads the parameters from one safetensors file's bytes held in memory (a version
    /// that arrived over the weights broadcast: no file written, none read back). `name`
    /// stands for the file in errors.
    pub fn load_weight_bytes(&mut self, bytes: &[u8], name: &str) -> Result<(), PolicyError> {
        self.load_weight_buffers(&[(PathBuf::from(name), bytes)])
    }

    /// [`Policy::load_weight_files`] over the files' bytes, each named by its path.
    fn load_weight_buffers(&mut self, buffers: &[(PathBuf, &[u8])]) -> Result<(), PolicyError> {
        let bad = |path: &Path, message: String| PolicyError::Safetensors {
            path: path.to_path_buf(),
            message,
        };
        let files: Vec<PathBuf> = buffers.iter().map(|(f, _)| f.clone()).collect();
        let files = &files[..];
        let mut parsed = Vec::with_capacity(buffers.len());
        for (file, map) in buffers {
            check_data_offsets(map).map_err(|m| bad(file, m))?;
            let st = SafeTensors::deserialize(map).map_err(|e| bad(file, format!("{e:?}")))?;
            parsed.push((file, st));
        }
        // name -> index of the file holding it
        let mut found: HashMap<String, usize> = HashMap::new();
        for (i, (_, st)) in parsed.iter().enumerate() {
            for name in st.names() {
                found.insert(name.clone(), i);
            }
        }
        let describe = || match files {
            [one] => one.clone(),
            _ => PathBuf::from(
                files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
        };

        let mut vars: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut views = Vec::with_capacity(vars.len());
        for (name, var) in &vars {
            let Some(&i) = found.get(name) else {
                return Err(PolicyError::MissingTensor {
                    path: describe(),
                    name: name.clone(),
                });
            };
            let (file, st) = &parsed[i];
            let view = st.tensor(name).map_err(|e| bad(file, format!("{e:?}")))?;
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            if shape != var.size() {
                return Err(PolicyError::ShapeMismatch {
                    path: file.to_path_buf(),
                    name: name.clone(),
                    expected: var.size(),
                    found: shape,
                });
            }
            if !matches!(
                view.dtype(),
                Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64
            ) {
                return Err(bad(
                    file,
                    format!(
                        "tensor `{name}` has dtype {:?}, expected a float type",
                        view.dtype()
                    ),
                ));
            }
            views.push((file, view));
        }
        let known: BTreeSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&String> = found
            .keys()
            .filter(|n| !known.contains(n.as_str()))
            .collect();
        if !extra.is_empty() {
            tracing::debug!(
                count = extra.len(),
                ?extra,
                "ignoring checkpoint tensors the model does not use"
            );
        }
        let result = tch::no_grad(|| {
            for ((name, mut var), (file, view)) in vars.into_iter().zip(views) {
                // Past the checks, any failure leaves some tensors copied: a Torch error, which
                // callers treat as weights of no known version.
                let src = Tensor::try_from(view).map_err(|e| PolicyError::Torch {
                    context: format!("reading tensor `{name}` of {}", file.display()),
                    source: e,
                })?;
                // `copy_` converts dtype and device; `src` is dropped right after.
                var.f_copy_(&src).map_err(|e| PolicyError::Torch {
                    context: format!("copying tensor `{name}` into the model"),
                    source: e,
                })?;
            }
            Ok(())
        });
        // Packed copies for generation would still hold the old weights.
        if self.model.is_packed() {
            self.model.pack();
        }
        result
    }
}

/// Checks that no tensor in a safetensors header claims data past the end of the file,
/// before `safetensors` itself parses it: safetensors 0.3 adds the last tensor's end
/// offset to the header size unchecked, so a header that claims a `usize::MAX`-byte
/// tensor (a valid shape for it: `[18446744073709551615]` of U8) overflows, a panic in
/// debug builds. Anything else wrong is left to `safetensors`, which words it.
fn check_data_offsets(file: &[u8]) -> Result<(), String> {
    let Some(len) = file.get(..8) else {
        return Ok(());
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    let Some(header) = usize::try_from(n)
        .ok()
        .and_then(|n| file.get(8..n.checked_add(8)?))
    else {
        return Ok(());
    };
    let data_len = (file.len() - 8 - header.len()) as u64;
    let Ok(serde_json::Value::Object(tensors)) = serde_json::from_slice(header) else {
        return Ok(());
    };
    for (name, info) in &tensors {
        let Some(offsets) = info.get("data_offsets").and_then(|o| o.as_array()) else {
            continue;
        };
        if offsets
            .iter()
            .any(|o| o.as_u64().is_some_and(|o| o > data_len))
        {
            return Err(format!(
                "tensor `{name}` has data_offsets {} past the end of the file's {data_len} \
                 bytes of tensor data (truncated or corrupt file?)",
                serde_json::Value::Array(offsets.clone())
            ));
        }
    }
    Ok(())
}

/// A shard name from `weight_map` that stays inside the checkpoint directory: relative,
/// not empty, and without `..` (a hostile index could name `/etc/passwd` or
/// `../../secret` otherwise, and the loader would read, and `tutor` copy, that file).
fn shard_inside_dir(name: &str) -> bool {
    use std::path::Component;
    let p = Path::new(name);
    p.components().any(|c| matches!(c, Component::Normal(_)))
        && p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// The weight files of a Hugging Face checkpoint directory: `model.safetensors`, or the
/// shards `model.safetensors.index.json` names (in name order; not checked to exist).
/// Every shard must be inside `dir` (see `shard_inside_dir`); the error names the entry.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, PolicyError> {
    let single = dir.join(WEIGHTS_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return Err(PolicyError::io(
            &single,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no {WEIGHTS_FILE} or {INDEX_FILE} in the checkpoint directory"),
            ),
        ));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| PolicyError::io(&index, e))?;
    let bad = |message: String| PolicyError::Safetensors {
        path: index.clone(),
        message,
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".to_string()))?;
    let mut shards = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("`weight_map.{name}` is not a file name")))?;
        if !shard_inside_dir(file) {
            return Err(bad(format!(
                "`weight_map.{name}` is {file:?}, not a file inside the checkpoint directory \
                 (shard names must be relative, without `..`)"
            )));
        }
        // Without its `.` components: `./a.safetensors` is `a.safetensors`.
        shards.insert(
            Path::new(file)
                .components()
                .filter(|c| matches!(c, std::path::Component::Normal(_)))
                .collect::<PathBuf>(),
        );
    }
    Ok(shards.into_iter().map(|f| dir.join(f)).collect())
}

fn dtype_name(kind: tch::Kind) -> &'static str {
    match kind {
        tch::Kind::BFloat16 => "bfloat16",
        tch::Kind::Half => "float16",
        tch::Kind::Double => "float64",
        _ => "float32",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::tiny_policy;
    use crate::GenParams;
    use tch::Kind;

    fn sample_out(p: &Policy) -> Vec<u32> {
        let params = GenParams {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 8,
            seed: 3,
            stop_token_ids: vec![],
        };
        p.generate(&[vec![1, 2, 3]], &[params]).remove(0).tokens
    }

    #[test]
    fn weights_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let a = tiny_policy(1);
        a.save_weights(&path).unwrap();
        let mut b = tiny_policy(2);
        assert_ne!(sample_out(&a), sample_out(&b));
        b.load_weights(&path).unwrap();
        assert_eq!(sample_out(&a), sample_out(&b));
        let ids = Tensor::from_slice(&[4i64, 5, 6]).unsqueeze(0);
        let m = Tensor::ones([1, 3], (Kind::Int64, Device::Cpu));
        assert!(a.forward(&ids, &m).equal(&b.forward(&ids, &m)));
    }

    #[test]
    fn dir_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let a = tiny_policy(4);
        a.save_dir(dir.path()).unwrap();
        assert!(dir.path().join("config.json").exists());
        let b = Policy::load_dir(dir.path(), Device::Cpu).unwrap();
        assert_eq!(b.config(), a.config());
        assert_eq!(sample_out(&a), sample_out(&b));
    }

    #[test]
    fn bfloat16_checkpoint_loads_into_float_model() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = tiny_policy(5);
        a.var_store_mut().bfloat16();
        a.save_dir(dir.path()).unwrap();
        let config = ModelConfig::load(&dir.path().join("config.json")).unwrap();
        assert_eq!(config.torch_dtype, "bfloat16");
        let b = Policy::load_dir(dir.path(), Device::Cpu).unwrap();
        let w = &b.var_store().variables()["model.norm.weight"];
        assert_eq!(w.kind(), Kind::Float);
    }

    #[test]
    fn sharded_checkpoint_loads() {
        let dir = tempfile::tempdir().unwrap();
        let a = tiny_policy(6);
        let mut named: Vec<(String, Tensor)> = a.var_store().variables().into_iter().collect();
        named.sort_by(|x, y| x.0.cmp(&y.0));
        let (first, second) = named.split_at(named.len() / 2);
        let mut map = serde_json::Map::new();
        for (file, part) in [
            ("model-00001-of-00002.safetensors", first),
            ("model-00002-of-00002.safetensors", second),
        ] {
            Tensor::write_safetensors(part, dir.path().join(file)).unwrap();
            for (n, _) in part {
                map.insert(n.clone(), file.into());
            }
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
        a.config().save(&dir.path().join("config.json")).unwrap();
        let b = Policy::load_dir(dir.path(), Device::Cpu).unwrap();
        assert_eq!(sample_out(&a), sample_out(&b));
    }

    #[test]
    fn wrong_shape_is_an_error_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        let a = tiny_policy(1);
        let mut named: Vec<(String, Tensor)> = a.var_store().variables().into_iter().collect();
        for (name, t) in named.iter_mut() {
            if name == "model.layers.1.mlp.up_proj.weight" {
                *t = Tensor::zeros([3, 3], (Kind::Float, Device::Cpu));
            }
        }
        Tensor::write_safetensors(&named, &path).unwrap();
        let mut b = tiny_policy(2);
        let before = sample_out(&b);
        let msg = b.load_weights(&path).unwrap_err().to_string();
        assert!(msg.contains("model.layers.1.mlp.up_proj.weight"), "{msg}");
        assert!(msg.contains("bad.safetensors"), "{msg}");
        // Nothing was copied.
        assert_eq!(sample_out(&b), before);
    }

    #[test]
    fn missing_tensor_and_garbage_file_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("partial.safetensors");
        let a = tiny_policy(1);
        let named: Vec<(String, Tensor)> = a
            .var_store()
            .variables()
            .into_iter()
            .filter(|(n, _)| n != "model.norm.weight")
            .collect();
        Tensor::write_safetensors(&named, &path).unwrap();
        let mut b = tiny_policy(2);
        let msg = b.load_weights(&path).unwrap_err().to_string();
        assert!(
            msg.contains("model.norm.weight") && msg.contains("partial.safetensors"),
            "{msg}"
        );

        let junk = dir.path().join("junk.safetensors");
        std::fs::write(&junk, b"definitely not safetensors").unwrap();
        let msg = b.load_weights(&junk).unwrap_err().to_string();
        assert!(msg.contains("junk.safetensors"), "{msg}");
        let msg = b
            .load_weights(&dir.path().join("absent.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("absent.safetensors"), "{msg}");
        let msg = Policy::load_dir(dir.path(), Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("config.json"), "{msg}");
    }
}
