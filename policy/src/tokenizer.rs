//! Byte-level BPE tokenizer and the chat format its model was trained with.
//!
//! Either trained here from a corpus (for toy models) or loaded from a Hugging Face
//! `tokenizer.json` (for real checkpoints). Special token ids are looked up by name, so a
//! real Qwen tokenizer (where `<|im_end|>` is 151645) works the same as a trained one
//! (where it is 2).
//!
//! Chats are rendered either in the built-in ChatML (Tutor's own models and ChatML
//! tokenizers without a template) or with the model directory's chat template, for any
//! model family: the template says which special token closes an assistant turn (ChatML's
//! `<|im_end|>`, Llama-3's `<|eot_id|>`, Mistral's `</s>`, ...), and generation stops on
//! that token and on the model's end-of-sequence tokens (`generation_config.json`).
//!
//! Chat rendering inserts the special tokens by id and encodes message *contents* with
//! special-token recognition turned off: a file or command output that happens to contain
//! the text `<|im_end|>` must not end a turn in the middle of an observation. Between
//! special tokens this gives the same ids as encoding the whole rendered string, since the
//! tokenizer splits on special tokens before anything else.

use std::path::Path;
use std::sync::Arc;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder,
};

use crate::chat_template::ChatTemplate;
use crate::PolicyError;

pub const ENDOFTEXT: &str = "<|endoftext|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// Where generation settings (`eos_token_id`) are read from, as `transformers`' `generate`
/// reads them: `generation_config.json`, else the model's `config.json`.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
const MODEL_CONFIG_FILE: &str = "config.json";

/// How chats are rendered into ids.
#[derive(Clone)]
enum Format {
    /// The built-in ChatML, by the ids of its two tokens.
    ChatMl { im_start: u32, im_end: u32 },
    /// The model directory's own template.
    Template(Arc<ChatTemplate>),
}

#[derive(Clone)]
pub struct ChatTokenizer {
    /// Recognizes special tokens in text.
    tokenizer: Tokenizer,
    /// The same vocabulary, encoding special-token strings as ordinary text.
    plain: Tokenizer,
    format: Format,
    /// The special token that closes an assistant turn (and ends a generated message).
    turn_end: u32,
    /// Generation stops on any of these: `turn_end`, then the model's end-of-sequence
    /// tokens, no id twice.
    stops: Vec<u32>,
    /// The text of every special token (to spot message contents that contain one).
    specials: Vec<String>,
}

/// Stands for one message content in a second rendering (see `template_ids`).
const SENTINEL: char = '\u{F8FF}';

/// Stand in for contents when a template is probed for its turn structure.
const PROBE_USER: &str = "\u{E001}";
const PROBE_MARK: &str = "\u{E000}";

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("turn_end", &self.turn_end)
            .field("stops", &self.stops)
            .field("template", &self.template().map(|t| t.source()))
            .finish()
    }
}

impl ChatTokenizer {
    /// Trains a byte-level BPE on `corpus`. The special tokens get ids 0, 1, 2, then the 256
    /// byte symbols, then merges up to `vocab_size` (which therefore must be at least 259).
    /// The same corpus and size give the same tokenizer.
    pub fn train(corpus: &[String], vocab_size: usize) -> Result<Self, PolicyError> {
        let min = 3 + 256;
        if vocab_size < min {
            return Err(PolicyError::Tokenizer {
                context: "training".to_string(),
                message: format!(
                    "vocab_size {vocab_size} is below {min} (3 special tokens + 256 bytes)"
                ),
            });
        }
        let specials = [ENDOFTEXT, IM_START, IM_END]
            .map(|s| AddedToken::from(s, true))
            .to_vec();
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials)
            // Every byte gets a symbol, so any text encodes without an unknown token.
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut tk = TokenizerBuilder::<
            BPE,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
        .with_decoder(Some(ByteLevel::new(false, true, true).into()))
        .build()
        .map_err(|e| tok_err("building the tokenizer", e))?;
        tk.train(&mut trainer, corpus.iter())
            .map_err(|e| tok_err("training", e))?;
        Self::build(Tokenizer::from(tk), None, &[], "being trained")
    }

    /// Loads a Hugging Face `tokenizer.json` alone, rendering chats in the built-in
    /// ChatML: the vocabulary must have `<|im_start|>` and `<|im_end|>`. A model of
    /// another family is loaded with [`ChatTokenizer::from_dir`], which reads its template.
    pub fn from_file(path: &Path) -> Result<Self, PolicyError> {
        let tokenizer = load_tokenizer(path)?;
        Self::build(tokenizer, None, &[], &path.display().to_string())
    }

    /// Loads a model directory's tokenizer: `tokenizer.json`, the chat template
    /// `transformers` would use (`chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template`; see [`ChatTemplate::from_dir`]) and the end-of-sequence tokens
    /// generation stops on (`generation_config.json`'s `eos_token_id`, else
    /// `config.json`'s; and the template's `eos_token`). Without a template, prompts are
    /// rendered in the built-in ChatML, which needs its tokens in the vocabulary.
    pub fn from_dir(dir: &Path) -> Result<Self, PolicyError> {
        let path = dir.join("tokenizer.json");
        let tokenizer = load_tokenizer(&path)?;
        let template = ChatTemplate::from_dir(dir)?;
        let mut eos = vec![];
        if let Some((ids, file)) = eos_token_ids(dir)? {
            let vocab = tokenizer.get_vocab_size(true);
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(tok_err(
                    &file.display().to_string(),
                    format!(
                        "field `eos_token_id`: {bad} is outside the {vocab} ids of {}",
                        path.display()
                    ),
                ));
            }
            eos = ids;
        }
        if let Some(t) = &template {
            if let Some(id) = t
                .special_tokens()
                .get("eos_token")
                .and_then(|e| tokenizer.token_to_id(e))
            {
                eos.push(id);
            }
        }
        Self::build(tokenizer, template, &eos, &dir.display().to_string())
    }

    /// The tokenizer with its chat format: the template when there is one (its turn end
    /// found by rendering a probe conversation), else ChatML; then the stop ids.
    fn build(
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        eos: &[u32],
        context: &str,
    ) -> Result<Self, PolicyError> {
        // Every added token is structure, special or not (DeepSeek's role markers
        // `<｜User｜>`, `<｜Assistant｜>` are added tokens marked non-special): message
        // contents must never produce one. `plain` has them all marked special, and
        // encodes special tokens as text.
        let mut specials: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .values()
            .filter(|t| !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        specials.sort();
        let mut plain = tokenizer.clone();
        let non_special: Vec<AddedToken> = tokenizer
            .get_added_tokens_decoder()
            .values()
            .filter(|t| !t.special && !t.content.is_empty())
            .map(|t| {
                let mut t = t.clone();
                t.special = true;
                t
            })
            .collect();
        if !non_special.is_empty() {
            plain.add_special_tokens(&non_special);
        }
        plain.set_encode_special_tokens(true);
        let (format, turn_end) = match template {
            Some(t) => {
                let turn_end = template_turn_end(&tokenizer, &specials, &t)?;
                // An episode's first prompt must render (with the system prompt folded
                // into the user message where the template refuses system messages).
                let folded = fold_system(PROBE_USER, PROBE_USER);
                if let Err(e) = t.render([("system", PROBE_USER), ("user", PROBE_USER)], true) {
                    t.render([("user", folded.as_str())], true).map_err(|_| e)?;
                }
                (Format::Template(Arc::new(t)), turn_end)
            }
            None => {
                let id = |token: &str| {
                    tokenizer
                        .token_to_id(token)
                        .ok_or_else(|| PolicyError::MissingSpecialToken {
                            context: context.to_string(),
                            token: token.to_string(),
                        })
                };
                let (im_start, im_end) = (id(IM_START)?, id(IM_END)?);
                (Format::ChatMl { im_start, im_end }, im_end)
            }
        };
        let mut stops = vec![turn_end];
        // ChatML's end of text ends a generation too, as Qwen's generation configs say.
        let endoftext = tokenizer.token_to_id(ENDOFTEXT);
        for &id in eos.iter().chain(endoftext.iter()) {
            if !stops.contains(&id) {
                stops.push(id);
            }
        }
        Ok(ChatTokenizer {
            tokenizer,
            plain,
            format,
            turn_end,
            stops,
            specials,
        })
    }

    /// The chat template prompts are rendered with (`None`: the built-in ChatML).
    pub fn template(&self) -> Option<&ChatTemplate> {
        match &self.format {
            Format::Template(t) => Some(t),
            Format::ChatMl { .. } => None,
        }
    }

    /// Writes `tokenizer.json`, loadable by Hugging Face `tokenizers`.
    pub fn save(&self, path: &Path) -> Result<(), PolicyError> {
        self.tokenizer
            .save(path, true)
            .map_err(|e| tok_err(&path.display().to_string(), e))
    }

    /// Number of ids, special tokens included: the minimum `vocab_size` of a model.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Encodes text; special-token strings in it become their special ids.
    ///
    /// Panics only if the tokenizer itself is broken (a byte-level BPE encodes any text);
    /// [`ChatTokenizer::try_encode`] returns that as an error instead.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>, PolicyError> {
        encode_with(&self.tokenizer, text)
    }

    /// Encodes text with special-token strings treated as ordinary text.
    pub fn encode_plain(&self, text: &str) -> Vec<u32> {
        encode_with(&self.plain, text).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Decodes ids to text, leaving special tokens out. Byte sequences that are not valid
    /// UTF-8 (e.g. a generation cut inside a character) become U+FFFD; unknown ids are
    /// skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "tokenizer could not decode ids");
            String::from(char::REPLACEMENT_CHARACTER)
        })
    }

    /// One token's text, special tokens included (a token holding part of a UTF-8
    /// character shows as U+FFFD).
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The text `ids` stand for, special tokens included: what the model reads.
    pub fn render_text(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "tokenizer could not decode ids");
            String::from(char::REPLACEMENT_CHARACTER)
        })
    }

    /// The special token that closes an assistant turn: ChatML's `<|im_end|>`, or what
    /// the model's template writes right after an assistant message (Llama-3's
    /// `<|eot_id|>`). A generated message ends with it.
    pub fn turn_end_id(&self) -> u32 {
        self.turn_end
    }

    /// The ids generation stops on: the turn end first, then the model's end-of-sequence
    /// tokens.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stops
    }

    /// The id of a token by its text (special tokens included), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The first prompt of an episode: a system and a user message, then the assistant
    /// header. Built-in ChatML:
    /// `<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n`
    ///
    /// A template that refuses a system message (Gemma's, Mistral's first ones raise
    /// "System role not supported" or require alternating user/assistant turns) gets the
    /// system prompt at the head of the user message instead, separated by a blank line,
    /// as those models' own guidance says.
    pub fn render_prompt(&self, system: &str, user: &str) -> Result<Vec<u32>, PolicyError> {
        match self.render_chat([("system", system), ("user", user)]) {
            Err(e) if self.template().is_some() => {
                let folded = fold_system(system, user);
                self.render_chat([("user", folded.as_str())]).map_err(|_| e)
            }
            rendered => rendered,
        }
    }

    /// A whole conversation, as chat-completions clients send it, with the generation
    /// prompt. With the model's template: what `apply_chat_template(messages,
    /// add_generation_prompt=True)` renders, encoded (see `template_ids` for contents that
    /// contain special-token text). Built-in ChatML: every message as
    /// `<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n`.
    /// Errors only from a template (a `raise_exception`, or a render error).
    pub fn render_chat<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Vec<u32>, PolicyError> {
        let messages: Vec<(&str, &str)> = messages.into_iter().collect();
        if let Some(t) = self.template() {
            return self.template_ids(t, &messages, true, None);
        }
        let mut ids = Vec::new();
        for (role, content) in messages {
            ids.extend(self.message(role, content));
            ids.extend(self.encode_plain("\n"));
        }
        ids.extend(self.assistant_header());
        Ok(ids)
    }

    /// What follows an assistant turn that ended with its turn end (`turn_end_id`, the
    /// token the rollouts stop on): the rest of that turn's closing text, the observation
    /// as a user message, and the next assistant header. Built-in ChatML:
    /// `\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n`.
    ///
    /// With the model's template: the template renders `[user, assistant, user
    /// observation]` with the generation prompt, and the delta is what follows the
    /// assistant's content and its turn end. The history before it is never rendered
    /// or encoded again, so generated ids stay as generated.
    pub fn render_observation(&self, observation: &str) -> Result<Vec<u32>, PolicyError> {
        let Some(t) = self.template() else {
            let mut ids = self.encode_plain("\n");
            ids.extend(self.message("user", observation));
            ids.extend(self.encode_plain("\n"));
            ids.extend(self.assistant_header());
            return Ok(ids);
        };
        let stop = self.token_text(self.turn_end);
        // The probe's characters (private-use code points) cannot come from the
        // observation, or it could move the cut.
        let observation = strip_probe_chars(observation);
        let messages = [
            ("user", PROBE_USER),
            ("assistant", PROBE_MARK),
            ("user", observation.as_ref()),
        ];
        self.template_ids(t, &messages, true, Some((PROBE_MARK, &stop)))
    }

    /// Renders `messages` with the template, keeps what follows `after` = (marker, stop)
    /// when given (an error if the marker is not followed by the stop text), and encodes
    /// it.
    ///
    /// `transformers` encodes the rendered text as a whole, so a special-token string in a
    /// message content (a file that contains `<|im_end|>`) becomes that special token.
    /// Here such contents stay plain text: the template renders a second time with each
    /// of them replaced by a sentinel, template text is encoded with special tokens and
    /// contents without; if putting the contents back in place of the sentinels does not
    /// give the first rendering (the template changed the content, e.g. `| trim`), the
    /// first rendering is encoded as a whole, as `transformers` does. Contents without
    /// special-token text give exactly `transformers`' ids.
    fn template_ids(
        &self,
        t: &ChatTemplate,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
        after: Option<(&str, &str)>,
    ) -> Result<Vec<u32>, PolicyError> {
        let cut = |text: String| -> Result<String, PolicyError> {
            let Some((mark, stop)) = after else {
                return Ok(text);
            };
            // The assistant's content is where the marker is followed by the turn end (a
            // template may also print the messages as JSON before, marker and all).
            text.match_indices(mark)
                .find_map(|(at, _)| text[at + mark.len()..].strip_prefix(stop))
                .map(str::to_owned)
                .ok_or_else(|| PolicyError::Tokenizer {
                    context: t.source().to_string(),
                    message: format!(
                        "the chat template does not close an assistant turn with {stop} right \
                         after its content, so an observation cannot follow generated tokens"
                    ),
                })
        };
        let text = cut(t.render(messages.iter().copied(), add_generation_prompt)?)?;
        let text = text.as_str();
        let risky: Vec<usize> = (0..messages.len())
            .filter(|&i| {
                self.specials
                    .iter()
                    .any(|s| messages[i].1.contains(s.as_str()))
            })
            .collect();
        if risky.is_empty() {
            return self.try_encode(text);
        }
        let sentinels: Vec<String> = (0..risky.len())
            .map(|k| format!("{SENTINEL}{k}{SENTINEL}"))
            .collect();
        let masked: Vec<(&str, &str)> = messages
            .iter()
            .enumerate()
            .map(
                |(i, &(role, content))| match risky.iter().position(|&r| r == i) {
                    Some(k) => (role, sentinels[k].as_str()),
                    None => (role, content),
                },
            )
            .collect();
        let masked_text = cut(t.render(masked.iter().copied(), add_generation_prompt)?)?;
        // The contents as they are, else as Jinja's `| trim` leaves them (Llama-3's and
        // Gemma's templates trim every message); the template's own text between them
        // is encoded with special tokens, the contents never.
        let (ids, rebuilt) = self.splice(&masked_text, messages, &risky, |c| c)?;
        if rebuilt == text {
            return Ok(ids);
        }
        let (trimmed_ids, rebuilt) = self.splice(&masked_text, messages, &risky, py_strip)?;
        if rebuilt == text {
            return Ok(trimmed_ids);
        }
        tracing::warn!(
            template = t.source(),
            "the chat template changes message contents that contain special-token text \
             (beyond trimming them): they are kept as given, as plain text"
        );
        Ok(ids)
    }

    /// `masked_text` with each sentinel replaced by its risky content passed through
    /// `transform`: the ids (template text with special tokens, contents as plain text)
    /// and the text they spell.
    fn splice(
        &self,
        masked_text: &str,
        messages: &[(&str, &str)],
        risky: &[usize],
        transform: impl Fn(&str) -> &str,
    ) -> Result<(Vec<u32>, String), PolicyError> {
        let mut rest = masked_text;
        let mut ids = Vec::new();
        let mut rebuilt = String::new();
        while !rest.is_empty() {
            // The next sentinel, if any: `SENTINEL digits SENTINEL` naming a risky content.
            let next = rest.match_indices(SENTINEL).find_map(|(at, _)| {
                let after = &rest[at + SENTINEL.len_utf8()..];
                let end = after.find(SENTINEL)?;
                let k: usize = after[..end].parse().ok()?;
                (k < risky.len()).then_some((at, k, at + 2 * SENTINEL.len_utf8() + end))
            });
            let (before, content, after) = match next {
                Some((at, k, end)) => (&rest[..at], Some(messages[risky[k]].1), &rest[end..]),
                None => (rest, None, ""),
            };
            ids.extend(self.try_encode(before)?);
            rebuilt.push_str(before);
            if let Some(c) = content {
                let c = transform(c);
                ids.extend(encode_with(&self.plain, c)?);
                rebuilt.push_str(c);
            }
            rest = after;
        }
        Ok((ids, rebuilt))
    }

    /// A teacher's text as assistant tokens: the text followed by the turn end.
    pub fn encode_assistant(&self, text: &str) -> Vec<u32> {
        let mut ids = self.encode_plain(text);
        ids.push(self.turn_end);
        ids
    }

    /// ChatML's two token ids; only called where no template is set, which `build` makes
    /// ChatML.
    fn chatml(&self) -> (u32, u32) {
        match self.format {
            Format::ChatMl { im_start, im_end } => (im_start, im_end),
            Format::Template(_) => unreachable!("ChatML rendering with a template set"),
        }
    }

    /// `<|im_start|>{role}\n{content}<|im_end|>`
    fn message(&self, role: &str, content: &str) -> Vec<u32> {
        let (im_start, im_end) = self.chatml();
        let mut ids = vec![im_start];
        ids.extend(self.encode_plain(&format!("{role}\n{content}")));
        ids.push(im_end);
        ids
    }

    fn assistant_header(&self) -> Vec<u32> {
        let mut ids = vec![self.chatml().0];
        ids.extend(self.encode_plain("assistant\n"));
        ids
    }
}

/// `text` without the probe's characters (replaced by U+FFFD), borrowed when it has none.
fn strip_probe_chars(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains([PROBE_USER, PROBE_MARK].map(|s| s.chars().next().unwrap())) {
        text.replace(PROBE_USER, "\u{FFFD}")
            .replace(PROBE_MARK, "\u{FFFD}")
            .into()
    } else {
        text.into()
    }
}

/// The first user message of a template that refuses system messages: the system
/// prompt at its head, a blank line between.
fn fold_system(system: &str, user: &str) -> String {
    format!("{system}\n\n{user}")
}

/// Python's `str.strip()` with no argument, as Jinja's `trim` filter applies it.
fn py_strip(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

fn load_tokenizer(path: &Path) -> Result<Tokenizer, PolicyError> {
    if !path.exists() {
        return Err(PolicyError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        ));
    }
    Tokenizer::from_file(path).map_err(|e| tok_err(&path.display().to_string(), e))
}

/// The special token a template writes right after an assistant message's content: what
/// closes a turn, and what generation must stop on. Found by rendering a probe
/// conversation `[user, assistant]` without the generation prompt.
fn template_turn_end(
    tokenizer: &Tokenizer,
    specials: &[String],
    t: &ChatTemplate,
) -> Result<u32, PolicyError> {
    let text = t.render([("user", PROBE_USER), ("assistant", PROBE_MARK)], false)?;
    // The assistant's content is the last message; a template may print the messages
    // (as JSON) before it, so the last marker is the content's.
    let Some((_, after)) = text.rsplit_once(PROBE_MARK) else {
        return Err(tok_err(
            t.source(),
            "the chat template leaves out the content of an assistant message, so a \
             generated turn cannot be placed in the conversation",
        ));
    };
    specials
        .iter()
        .filter(|s| after.starts_with(s.as_str()))
        .max_by_key(|s| s.len())
        .and_then(|s| tokenizer.token_to_id(s))
        .ok_or_else(|| {
            let shown: String = after.chars().take(40).collect();
            tok_err(
                t.source(),
                format!(
                    "the chat template does not close an assistant message with a special \
                     token right after its content (it writes {shown:?}), so generation has \
                     no token to stop a turn on"
                ),
            )
        })
}

/// `eos_token_id` (an id or a list of ids) from `generation_config.json`, else from
/// `config.json`, with the file it came from; none when neither names it.
fn eos_token_ids(dir: &Path) -> Result<Option<(Vec<u32>, std::path::PathBuf)>, PolicyError> {
    for name in [GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE] {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| PolicyError::io(&path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| tok_err(&path.display().to_string(), format!("not JSON: {e}")))?;
        let bad = || {
            tok_err(
                &path.display().to_string(),
                "field `eos_token_id` must be a token id or a list of token ids",
            )
        };
        let as_id = |v: &serde_json::Value| {
            v.as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(bad)
        };
        let ids = match json.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(list)) => {
                list.iter().map(as_id).collect::<Result<_, _>>()?
            }
            Some(v) => vec![as_id(v)?],
        };
        return Ok(Some((ids, path)));
    }
    Ok(None)
}

fn encode_with(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PolicyError> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| tok_err("encoding", e))
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> PolicyError {
    PolicyError::Tokenizer {
        context: context.to_string(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> Vec<String> {
        let mut c = vec![
            "def add(a, b):\n    return a + b\n".to_string(),
            "The quick brown fox jumps over the lazy dog.".to_string(),
            "```command\nopen src/main.py 10\n```".to_string(),
            "Ünïcödé: naïve café, 日本語のテキスト, emoji 🦀🚀".to_string(),
            "\tindented\twith\ttabs\r\nand CRLF".to_string(),
        ];
        for i in 0..20 {
            c.push(format!(
                "line {i}: for x in range({i}):\n    print(x * {i})\n"
            ));
        }
        c
    }

    fn trained() -> ChatTokenizer {
        ChatTokenizer::train(&corpus(), 400).unwrap()
    }

    #[test]
    fn special_token_ids() {
        let t = trained();
        let ids = [ENDOFTEXT, IM_START, IM_END].map(|s| t.token_id(s).unwrap());
        assert_eq!(ids, [0, 1, 2]);
        // A turn ends at <|im_end|>; generation also stops at <|endoftext|>.
        assert_eq!(t.turn_end_id(), 2);
        assert_eq!(t.stop_ids(), [2, 0]);
        assert!(
            t.vocab_size() > 259 && t.vocab_size() <= 400,
            "{}",
            t.vocab_size()
        );
    }

    #[test]
    fn round_trips_any_text() {
        let t = trained();
        for s in [
            "",
            "hello world",
            "def f(x):\n\treturn x  # tab\n\n",
            "日本語 and ünïcödé, 🦀 not in the corpus: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q",
            "  leading and trailing spaces  ",
            "\0\u{7f}\u{1b}[31mcontrol\r\n",
        ] {
            let ids = t.encode(s);
            assert_eq!(t.decode(&ids), s, "ids {ids:?}");
            assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        }
        // Merges were learned: common text is shorter than its bytes.
        assert!(t.encode("    return a + b\n").len() < "    return a + b\n".len());
    }

    #[test]
    fn special_tokens_are_recognized_and_skipped_in_decode() {
        let t = trained();
        let ids = t.encode("hi<|im_end|>\n<|im_start|>user");
        assert!(ids.contains(&2) && ids.contains(&1), "{ids:?}");
        assert_eq!(t.decode(&ids), "hi\nuser");
        // With recognition off, the same string is plain bytes.
        let plain = t.encode_plain("<|im_end|>");
        assert!(!plain.contains(&2) && plain.len() > 1);
        assert_eq!(t.decode(&plain), "<|im_end|>");
    }

    #[test]
    fn decode_never_panics_on_bad_input() {
        let t = trained();
        let ids = t.encode("é"); // two bytes, likely two byte tokens
        let cut = t.decode(&ids[..ids.len() - 1]);
        if ids.len() > 1 {
            assert_eq!(cut, "\u{FFFD}");
        }
        assert_eq!(t.decode(&[u32::MAX, 99_999]), "");
    }

    #[test]
    fn chat_template() {
        let t = trained();
        let p = t
            .render_prompt("You are helpful.", "Fix <|im_end|> bug")
            .unwrap();
        assert_eq!(p[0], 1);
        assert_eq!(p.iter().filter(|&&i| i == 1).count(), 3);
        assert_eq!(
            p.iter().filter(|&&i| i == t.turn_end_id()).count(),
            2,
            "user text must not inject specials"
        );
        let rendered = t.tokenizer.decode(&p, false).unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nFix <|im_end|> bug<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render_chat([
                ("system", "You are helpful."),
                ("user", "Fix <|im_end|> bug")
            ])
            .unwrap(),
            p
        );
        let chat = t
            .render_chat([("user", "a"), ("assistant", "b"), ("user", "c")])
            .unwrap();
        assert_eq!(
            t.tokenizer.decode(&chat, false).unwrap(),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
        );
        let o = t.render_observation("ok").unwrap();
        assert_eq!(
            t.tokenizer.decode(&o, false).unwrap(),
            "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
        );
        let a = t.encode_assistant("ls -la");
        assert_eq!(*a.last().unwrap(), t.turn_end_id());
        assert_eq!(t.decode(&a), "ls -la");
        // Piecewise rendering gives the same ids as encoding the whole string.
        let whole = t.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(t.render_prompt("S", "U").unwrap(), whole);
    }

    #[test]
    fn training_is_deterministic() {
        let a = trained();
        let b = trained();
        assert_eq!(
            a.tokenizer.to_string(false).unwrap(),
            b.tokenizer.to_string(false).unwrap()
        );
        let mut other = corpus();
        other.push("zzzz zzzz zzzz zzzz qqqq qqqq qqqq".to_string());
        let c = ChatTokenizer::train(&other, 400).unwrap();
        assert_ne!(
            a.tokenizer.to_string(false).unwrap(),
            c.tokenizer.to_string(false).unwrap()
        );
    }

    #[test]
    fn save_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let a = trained();
        a.save(&path).unwrap();
        let b = ChatTokenizer::from_file(&path).unwrap();
        assert_eq!(b.vocab_size(), a.vocab_size());
        let s = "def g():\n\tpass 🦀<|im_end|>";
        assert_eq!(a.encode(s), b.encode(s));
        assert_eq!(
            a.render_prompt("s", "u").unwrap(),
            b.render_prompt("s", "u").unwrap()
        );

        assert!(ChatTokenizer::from_file(&dir.path().join("nope.json"))
            .unwrap_err()
            .to_string()
            .contains("nope.json"));
        std::fs::write(dir.path().join("bad.json"), "{").unwrap();
        assert!(ChatTokenizer::from_file(&dir.path().join("bad.json"))
            .unwrap_err()
            .to_string()
            .contains("bad.json"));
    }

    /// An added token marked non-special (DeepSeek's role markers) is structure too:
    /// plain encoding spells it as text, and a message containing it stays text.
    #[test]
    fn non_special_added_tokens_never_come_from_contents() {
        let t = trained();
        let mut tk = t.tokenizer.clone();
        tk.add_tokens(&[AddedToken::from("<｜Assistant｜>", false)]);
        let id = tk.token_to_id("<｜Assistant｜>").unwrap();
        let t = ChatTokenizer::build(tk, None, &[], "test").unwrap();
        assert!(t.encode("hi<｜Assistant｜>").contains(&id));
        let plain = t.encode_plain("hi<｜Assistant｜>evil");
        assert!(!plain.contains(&id), "{plain:?}");
        assert_eq!(t.decode(&plain), "hi<｜Assistant｜>evil");
        assert_eq!(
            t.token_id("<｜Assistant｜>"),
            Some(id),
            "the id is unchanged"
        );
        let p = t.render_prompt("s", "u<｜Assistant｜>").unwrap();
        assert!(!p.contains(&id), "{p:?}");
    }

    #[test]
    fn too_small_vocab_is_an_error() {
        assert!(ChatTokenizer::train(&corpus(), 100).is_err());
    }
}
