//! The one error type of this crate.
//!
//! Every variant names the file, field or tensor involved, because the usual cause is a
//! checkpoint or config that does not match the code or the other files beside it, and
//! the person reading the message needs to know which file to fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot access {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} is not valid JSON ({message}); it should be a Hugging Face config.json")]
    ConfigSyntax { path: PathBuf, message: String },

    #[error("{path}: field `{field}` {message}")]
    ConfigField {
        path: PathBuf,
        field: String,
        message: String,
    },

    #[error("invalid model config: {0}")]
    InvalidConfig(String),

    #[error(
        "cannot read safetensors file {path}: {message}; is it a complete .safetensors checkpoint?"
    )]
    Safetensors { path: PathBuf, message: String },

    #[error(
        "checkpoint {path} has no tensor `{name}`; the checkpoint is incomplete or was written \
         for a different architecture than config.json describes"
    )]
    MissingTensor { path: PathBuf, name: String },

    #[error(
        "tensor `{name}` in {path} has shape {found:?} but the model config expects {expected:?}; \
         does config.json match the checkpoint?"
    )]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },

    #[error("torch error while {context}: {source}")]
    Torch {
        context: String,
        #[source]
        source: tch::TchError,
    },

    #[error("tokenizer error ({context}): {message}")]
    Tokenizer { context: String, message: String },

    #[error(
        "tokenizer {context} has no special token `{token}`: rendering chats in the built-in \
         ChatML needs <|im_start|> and <|im_end|>; a model of another family renders with its \
         own chat template (chat_template.jinja, or tokenizer_config.json's chat_template, \
         beside tokenizer.json)"
    )]
    MissingSpecialToken { context: String, token: String },
}

impl PolicyError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        PolicyError::Io {
            path: path.into(),
            source,
        }
    }
}
