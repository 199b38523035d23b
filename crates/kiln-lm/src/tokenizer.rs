//! Tokenizers (HF `tokenizers`: `tokenizer.json`, or built from a GGUF's embedded vocab and
//! merges) and the chat templates of the instruct models kiln targets (ChatML for Qwen2.5 and
//! SmolLM2, Llama-3). No general Jinja engine: the template kind is recognised from the
//! model's template text and rendered by hand.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::generate::Detokenize;
use crate::gguf::GgufFile;

/// Errors of tokenizer loading and use.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// No tokenizer file where one was expected.
    #[error(
        "no tokenizer found at {0}: an HF model folder needs tokenizer.json (or use a GGUF file, which embeds its vocabulary)"
    )]
    Missing(String),
    /// The tokenizer file or GGUF vocabulary is invalid.
    #[error("invalid tokenizer {path}: {message}")]
    Invalid {
        /// Where it came from.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// One chat message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with that role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
}

/// The chat formats kiln renders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\ncontent<|im_end|>\n` (Qwen2.5, SmolLM2), with the system prompt the
    /// template inserts when the conversation has none.
    ChatMl {
        /// Default system prompt (Qwen2.5: "You are Qwen, created by Alibaba Cloud. You are a
        /// helpful assistant."; SmolLM2: "You are a helpful AI assistant named SmolLM, trained by
        /// Hugging Face").
        default_system: Option<String>,
    },
    /// Llama-3 headers: `<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>`.
    Llama3,
    /// No template: messages joined by newlines (base models).
    Plain,
}

impl ChatTemplate {
    /// Qwen2.5-Instruct's format.
    pub fn qwen2_5() -> Self {
        ChatTemplate::ChatMl {
            default_system: Some(
                "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.".into(),
            ),
        }
    }

    /// SmolLM2-Instruct's format.
    pub fn smollm2() -> Self {
        ChatTemplate::ChatMl {
            default_system: Some(
                "You are a helpful AI assistant named SmolLM, trained by Hugging Face".into(),
            ),
        }
    }

    /// Recognise the format from a Jinja chat template text (HF `chat_template`, GGUF
    /// `tokenizer.chat_template`).
    pub fn from_jinja(template: &str) -> Self {
        if template.contains("<|start_header_id|>") {
            return ChatTemplate::Llama3;
        }
        if template.contains("<|im_start|>") {
            // The default system prompt is a literal in the template; Jinja string escapes
            // (`\n`) may or may not have been decoded already.
            let marker = "<|im_start|>system";
            let default_system = template.find(marker).and_then(|i| {
                let rest = &template[i + marker.len()..];
                let rest = rest
                    .strip_prefix('\n')
                    .or_else(|| rest.strip_prefix("\\n"))?;
                let end = rest.find("<|im_end|>")?;
                let s = &rest[..end];
                (!s.contains("{{") && !s.contains('\'') && !s.is_empty())
                    .then(|| s.replace("\\n", "\n"))
            });
            return ChatTemplate::ChatMl { default_system };
        }
        ChatTemplate::Plain
    }

    /// Render `messages`; with `add_generation_prompt` the text ends where the assistant's reply
    /// starts.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut s = String::new();
        match self {
            ChatTemplate::ChatMl { default_system } => {
                if let Some(sys) = default_system
                    && messages.first().is_none_or(|m| m.role != "system")
                {
                    s.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
                }
                for m in messages {
                    s.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        m.role, m.content
                    ));
                }
                if add_generation_prompt {
                    s.push_str("<|im_start|>assistant\n");
                }
            }
            ChatTemplate::Llama3 => {
                s.push_str("<|begin_of_text|>");
                for m in messages {
                    s.push_str(&format!(
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        m.role,
                        m.content.trim()
                    ));
                }
                if add_generation_prompt {
                    s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
                }
            }
            ChatTemplate::Plain => {
                let parts: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                s.push_str(&parts.join("\n"));
                if add_generation_prompt && !s.is_empty() {
                    s.push('\n');
                }
            }
        }
        s
    }

    /// The token text that ends an assistant turn (`<|im_end|>`, `<|eot_id|>`).
    pub fn end_of_turn(&self) -> Option<&'static str> {
        match self {
            ChatTemplate::ChatMl { .. } => Some("<|im_end|>"),
            ChatTemplate::Llama3 => Some("<|eot_id|>"),
            ChatTemplate::Plain => None,
        }
    }
}

/// A tokenizer plus the model's chat format and special ids.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Chat format of the model.
    pub chat_template: ChatTemplate,
    /// Beginning-of-sequence id, if the model uses one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence id.
    pub eos_token_id: Option<u32>,
    /// Prepend BOS when encoding with specials.
    pub add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl Tokenizer {
    /// Load an HF folder's `tokenizer.json` (and `tokenizer_config.json` for the chat
    /// template and BOS handling when present).
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(TokenizerError::Missing(dir.display().to_string()));
        }
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Invalid {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        let mut tok = Self {
            inner,
            chat_template: ChatTemplate::Plain,
            bos_token_id: None,
            eos_token_id: None,
            add_bos: false,
        };
        let cfg_path = dir.join("tokenizer_config.json");
        if let Ok(text) = std::fs::read_to_string(&cfg_path) {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TokenizerError::Invalid {
                    path: cfg_path.display().to_string(),
                    message: e.to_string(),
                })?;
            if let Some(t) = v.get("chat_template").and_then(|t| t.as_str()) {
                tok.chat_template = ChatTemplate::from_jinja(t);
            }
            let special = |k: &str| {
                v.get(k)
                    .and_then(|t| t.as_str().or_else(|| t.get("content")?.as_str()))
                    .and_then(|s| tok.inner.token_to_id(s))
            };
            tok.bos_token_id = special("bos_token");
            tok.eos_token_id = special("eos_token");
            tok.add_bos = v
                .get("add_bos_token")
                .and_then(|b| b.as_bool())
                .unwrap_or(false);
        }
        Ok(tok)
    }

    /// Build the tokenizer a GGUF file embeds (`tokenizer.ggml.model = gpt2`: byte-level BPE),
    /// with the pre-tokenizer llama.cpp uses for its `tokenizer.ggml.pre` type.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let invalid = |m: &str| TokenizerError::Invalid {
            path: "GGUF tokenizer".into(),
            message: m.into(),
        };
        let model = file
            .meta("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if model != "gpt2" {
            return Err(invalid(&format!(
                "tokenizer.ggml.model `{model}` is not supported (only byte-level BPE `gpt2`)"
            )));
        }
        let tokens = file
            .tokens()
            .ok_or_else(|| invalid("tokenizer.ggml.tokens is missing"))?;
        let merges = file
            .merges()
            .ok_or_else(|| invalid("tokenizer.ggml.merges is missing"))?;
        let types = file.token_types().unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .filter_map(|m| m.split_once(' '))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| invalid(&e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = file
            .meta("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("gpt2");
        inner.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(types.iter())
            .filter(|(_, ty)| **ty == 3)
            .map(|(t, _)| AddedToken::from(t.clone(), true).normalized(false))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| invalid(&e.to_string()))?;
        let id = |k: &str| {
            file.meta(&format!("tokenizer.ggml.{k}"))
                .and_then(|v| v.as_u64())
                .map(|v| v as u32)
        };
        Ok(Self {
            inner,
            chat_template: file
                .meta("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(ChatTemplate::from_jinja)
                .unwrap_or(ChatTemplate::Plain),
            bos_token_id: id("bos_token_id"),
            eos_token_id: id("eos_token_id"),
            add_bos: file
                .meta("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        })
    }

    /// Number of tokens (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encode text. Special-token strings in the text (e.g. `<|im_start|>`) become their ids;
    /// with `add_bos` a BOS id is prepended when the model wants one.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos
            && self.add_bos
            && let Some(b) = self.bos_token_id
        {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decode ids to text (special tokens kept unless `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Render a conversation with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> String {
        self.chat_template.render(messages, add_generation_prompt)
    }

    /// Stop ids for chat generation: EOS and the end-of-turn token.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eos_token_id.into_iter().collect();
        if let Some(eot) = self
            .chat_template
            .end_of_turn()
            .and_then(|t| self.token_to_id(t))
            && !v.contains(&eot)
        {
            v.push(eot);
        }
        v
    }

    /// The underlying HF tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl Detokenize for Tokenizer {
    fn decode_ids(&self, ids: &[u32]) -> String {
        self.decode(ids, false).unwrap_or_default()
    }
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's pre-tokenizer types as HF pre-tokenizers.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let byte_level =
        |regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        Split::new(
            SplitPattern::Regex(re.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(PreTokenizerWrapper::Split)
        .map_err(|e| TokenizerError::Invalid {
            path: "GGUF tokenizer".into(),
            message: e.to_string(),
        })
    };
    Ok(match pre {
        // Digits one by one, then GPT-2's regex (llama.cpp: "\p{N}" then the GPT-2 pattern).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "dbrx" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(LLAMA3_SPLIT)?,
                byte_level(false),
            ]))
        }
        "qwen2" | "deepseek-r1-qwen" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(QWEN2_SPLIT)?,
            byte_level(false),
        ])),
        "gpt2" | "default" | "mpt" | "olmo" => byte_level(true),
        other => {
            return Err(TokenizerError::Invalid {
                path: "GGUF tokenizer".into(),
                message: format!("pre-tokenizer type `{other}` is not supported"),
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_and_llama3_render() {
        let t = ChatTemplate::smollm2();
        let s = t.render(&[ChatMessage::user("Hi")], true);
        assert_eq!(
            s,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let s = ChatTemplate::qwen2_5().render(
            &[ChatMessage::system("Be brief."), ChatMessage::user("Hi")],
            false,
        );
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        let s = ChatTemplate::Llama3.render(&[ChatMessage::user("Hi")], true);
        assert_eq!(
            s,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn template_kind_is_recognised() {
        let smol = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}";
        assert_eq!(ChatTemplate::from_jinja(smol), ChatTemplate::smollm2());
        let qwen = "{%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}";
        assert_eq!(ChatTemplate::from_jinja(qwen), ChatTemplate::qwen2_5());
        assert_eq!(
            ChatTemplate::from_jinja("<|start_header_id|>"),
            ChatTemplate::Llama3
        );
    }

    #[test]
    fn missing_tokenizer_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::write(dir.path().join("tokenizer.json"), "{not json").unwrap();
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Invalid { .. }), "{err}");
    }
}
