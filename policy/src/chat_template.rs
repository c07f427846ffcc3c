//! A model directory's own chat template (Jinja), rendered as Hugging Face `transformers`
//! renders it in `apply_chat_template(..., tokenize=False)`.
//!
//! Where the template comes from, as `transformers` loads it: `chat_template.jinja` in the
//! directory (what current `save_pretrained` writes) wins; else `tokenizer_config.json`'s
//! `chat_template`, a string or a list of `{"name", "template"}` (the one named
//! `default`). A directory with neither has no template, and the tokenizer keeps its
//! built-in ChatML rendering.
//!
//! The environment follows `transformers`' `_compile_jinja_template`: `trim_blocks` and
//! `lstrip_blocks` on, loop controls (`break`/`continue`), a `raise_exception(msg)`
//! global that fails the render with `msg`, a `tojson` filter that writes what Python's
//! `json.dumps(x, ensure_ascii=False)` writes (not Jinja's HTML-escaping one; `indent`
//! and `sort_keys` are honoured), and Python's string/list/dict methods (`.strip()`,
//! `.split()`, `.startswith()`, `.items()`, ...) through minijinja-contrib's `pycompat`.
//! The variables are `messages` (each `{role, content}`), `add_generation_prompt`, `tools`
//! and `documents` (none), and the special tokens `tokenizer_config.json` names
//! (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
//! `mask_token`; a string or an `{"content": ...}` object).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use crate::PolicyError;

/// The template file `transformers` writes beside `tokenizer_config.json`.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The special-token names `transformers` passes to a template (`special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Instructions one render may run (minijinja's fuel). A real template spends about a
/// hundred per message (Qwen3's: ~72), so this is a 100 000-message conversation, and a
/// fraction of a second; a template that loops without end fails instead of hanging.
pub const RENDER_FUEL: u64 = 10_000_000;

/// Largest rendered prompt, in bytes: far over any model's context, and a bound on the
/// memory a template that prints without end can take.
pub const MAX_RENDER_BYTES: usize = 64 << 20;

/// `tojson`'s limits: Python's `json.dumps` takes any indent and nests ~1000 deep; a
/// template's own are far smaller, and unbounded ones would allocate or recurse at will.
const MAX_JSON_INDENT: usize = 256;
const MAX_JSON_DEPTH: usize = 256;

/// The render's output: refuses to grow past `cap` bytes (a write over it fails, which
/// ends the render).
struct CappedOutput {
    buf: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("the rendered prompt is too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template was read from (for error messages).
    source: String,
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

fn template_err(context: &str, message: impl std::fmt::Display) -> PolicyError {
    PolicyError::Tokenizer {
        context: context.to_string(),
        message: message.to_string(),
    }
}

/// minijinja's error with its cause chain (the template's own line is in the detail).
fn describe(e: &Error) -> String {
    let mut s = format!("{e:#}");
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    s
}

impl ChatTemplate {
    /// The chat template of a model directory, `None` when it has none (see the module
    /// docs for where it is looked up). Errors name the file and field at fault.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, PolicyError> {
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: serde_json::Value = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| PolicyError::io(&config_path, e))?;
            serde_json::from_str(&text).map_err(|e| {
                template_err(&config_path.display().to_string(), format!("not JSON: {e}"))
            })?
        } else {
            serde_json::Value::Null
        };
        let config_name = config_path.display().to_string();
        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        let (template, source) = if jinja_path.exists() {
            let text = std::fs::read_to_string(&jinja_path)
                .map_err(|e| PolicyError::io(&jinja_path, e))?;
            (text, jinja_path.display().to_string())
        } else {
            match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => {
                    (s.clone(), format!("{config_name}: field `chat_template`"))
                }
                Some(serde_json::Value::Array(list)) => {
                    let default = list
                        .iter()
                        .find(|t| t.get("name") == Some(&"default".into()));
                    match default.and_then(|t| t.get("template")).and_then(|t| t.as_str()) {
                        Some(s) => (
                            s.to_string(),
                            format!("{config_name}: field `chat_template` (\"default\")"),
                        ),
                        None => {
                            return Err(template_err(
                                &config_name,
                                "field `chat_template` is a list without a {\"name\": \"default\", \"template\": <string>} entry",
                            ))
                        }
                    }
                }
                Some(_) => {
                    return Err(template_err(
                        &config_name,
                        "field `chat_template` must be a string or a list of {name, template}",
                    ))
                }
            }
        };
        let mut special_tokens = BTreeMap::new();
        for key in SPECIAL_TOKEN_KEYS {
            let token = match config.get(key) {
                None | Some(serde_json::Value::Null) => continue,
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => match v.get("content").and_then(|c| c.as_str()) {
                    Some(s) => s.to_string(),
                    None => {
                        return Err(template_err(
                            &config_name,
                            format!(
                            "field `{key}` must be a string or an object with a string `content`"
                        ),
                        ))
                    }
                },
            };
            special_tokens.insert(key.to_string(), token);
        }
        Self::new(template, source, special_tokens).map(Some)
    }

    /// Compiles `template`; `source` names it in errors.
    pub fn new(
        template: String,
        source: String,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, PolicyError> {
        let mut env = Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", template)
            .map_err(|e| template_err(&source, describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source,
            special_tokens,
        })
    }

    /// Where the template came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special tokens the template is rendered with (`bos_token`, ...).
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// Renders `(role, content)` messages, as `apply_chat_template(messages,
    /// add_generation_prompt=..., tokenize=False)` does.
    pub fn render<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, &'a str)>,
        add_generation_prompt: bool,
    ) -> Result<String, PolicyError> {
        // Each message a map {role, content}, in that order (as `tojson` shows it).
        let messages: Vec<Value> = messages
            .into_iter()
            .map(|(role, content)| Value::from_pairs([("role", role), ("content", content)]))
            .collect();
        let mut ctx: Vec<(&str, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from(v.as_str())))
            .collect();
        ctx.push(("messages", Value::from(messages)));
        ctx.push(("add_generation_prompt", Value::from(add_generation_prompt)));
        ctx.push(("tools", Value::from(())));
        ctx.push(("documents", Value::from(())));
        let ctx = Value::from_pairs(ctx);
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| template_err(&self.source, describe(&e)))?;
        let context = format!("rendering {}", self.source);
        let mut out = CappedOutput {
            buf: Vec::new(),
            cap: MAX_RENDER_BYTES,
            over: false,
        };
        match template.render_captured_to(ctx, &mut out).map(drop) {
            // Whole `str` pieces are written or refused, so the bytes are UTF-8.
            Ok(_) => String::from_utf8(out.buf).map_err(|e| template_err(&context, e)),
            Err(_) if out.over => Err(template_err(
                &context,
                format!(
                    "the rendered prompt is over {MAX_RENDER_BYTES} bytes (MAX_RENDER_BYTES); \
                     does the template print without end?"
                ),
            )),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(template_err(
                &context,
                format!(
                    "the template ran more than {RENDER_FUEL} instructions (RENDER_FUEL) \
                     without finishing; does it loop without end? ({})",
                    describe(&e)
                ),
            )),
            Err(e) => Err(template_err(&context, describe(&e))),
        }
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`:
/// `", "` and `": "` between items without an indent, `","` and a newline with one; maps
/// in their own key order unless sorted.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    if let Some(n) = indent.filter(|&n| n > MAX_JSON_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: indent={n} is over the {MAX_JSON_INDENT} allowed"),
        ));
    }
    let opts = JsonOptions {
        indent,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOptions {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write_json(v: &Value, opts: &JsonOptions, depth: usize, out: &mut String) -> Result<(), Error> {
    use minijinja::value::ValueKind as K;
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: the value nests deeper than {MAX_JSON_DEPTH} levels"),
        ));
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = opts.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if opts.indent.is_some() { "," } else { ", " };
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else if f.fract() == 0.0 && f.abs() < 1e16 {
                    out.push_str(&format!("{f:.1}"));
                } else {
                    out.push_str(&f.to_string());
                }
            }
        }
        K::String => write_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        K::Seq | K::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, opts, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        K::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => write_str(k, opts.ensure_ascii, out),
                    None => write_str(&key.to_string(), opts.ensure_ascii, out),
                }
                out.push_str(": ");
                write_json(&v.get_item(key)?, opts, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot write a {} as JSON", v.kind()),
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src.to_string(), "test".into(), BTreeMap::new()).unwrap()
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = template("{{ messages[0] | tojson }}\n{{ messages[0] | tojson(indent=2) }}\n{{ {'b': 1, 'a': [true, none]} | tojson(sort_keys=true) }}");
        let out = t.render([("user", "<a & 'b'> \"é\"\n")], false).unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"<a & 'b'> \\\"é\\\"\\n\"}\n{\n  \"role\": \"user\",\n  \"content\": \"<a & 'b'> \\\"é\\\"\\n\"\n}\n{\"a\": [true, null], \"b\": 1}"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let t = template("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok");
        assert_eq!(t.render([("user", "x")], false).unwrap(), "ok");
        let err = t.render([("system", "x")], false).unwrap_err().to_string();
        assert!(err.contains("first must be user"), "{err}");
        assert!(err.contains("test"), "{err}");
    }

    #[test]
    fn python_string_methods_and_block_trimming() {
        let t = template(
            "{% for m in messages %}\n  {% if m.content.startswith(' ') %}\n[{{ m.content.strip() }}|{{ m.content.split('x') | length }}]\n  {% endif %}\n{% endfor %}\n",
        );
        assert_eq!(t.render([("user", " axbx ")], false).unwrap(), "[axbx|3]\n");
    }

    #[test]
    fn template_sources_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        let cfg = dir.path().join(TOKENIZER_CONFIG_FILE);
        std::fs::write(
            &cfg,
            r#"{"eos_token": {"content": "</s>"}, "bos_token": "<s>"}"#,
        )
        .unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        std::fs::write(
            &cfg,
            r#"{"bos_token": "<s>", "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render([], false).unwrap(), "<s>D");
        std::fs::write(dir.path().join(CHAT_TEMPLATE_FILE), "{{ bos_token }}J").unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render([], false).unwrap(), "<s>J");
        std::fs::write(dir.path().join(CHAT_TEMPLATE_FILE), "{% if %}").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains(CHAT_TEMPLATE_FILE), "{err}");
        std::fs::remove_file(dir.path().join(CHAT_TEMPLATE_FILE)).unwrap();
        std::fs::write(&cfg, r#"{"chat_template": 3}"#).unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(TOKENIZER_CONFIG_FILE) && err.contains("chat_template"),
            "{err}"
        );
        std::fs::write(&cfg, r#"{"eos_token": 3, "chat_template": "x"}"#).unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("eos_token"), "{err}");
    }
}
