//! The Search-R1 agent protocol as a pure state machine over text segments.
//!
//! One rollout is an [`Episode`]: a prompt ([`PromptTemplate::render`]) followed by assistant turns. Each turn
//! the policy generates text; generation stops at the first `</search>` or `</answer>` ([`STOP_STRINGS`]) and
//! anything after it is cut ([`parse_turn`]). Then:
//! - `<search> q </search>`: the episode asks for a search ([`Pending::Search`]); the caller runs it (top-k,
//!   default 3) and hands the passages back ([`Episode::push_search_results`]); they are appended as the
//!   observation `\n\n<information>Doc 1(Title: t) text\nDoc 2(Title: t) text</information>\n\n`
//!   ([`format_observation`]) and the next turn starts;
//! - `<answer> a </answer>`: the episode ends ([`EndReason::Answered`]);
//! - neither (or an empty query): the fixed [`INVALID_ACTION_OBSERVATION`] is appended and the next turn starts.
//!
//! At most `max_turns` assistant turns (default 4); the last one runs with search disabled: a search on the last
//! turn ends the episode without retrieving ([`EndReason::SearchOnLastTurn`]), an invalid last turn ends it with
//! [`EndReason::NoAnswer`].
//!
//! **Segments and token-in/token-out.** The response is a list of [`Step`]s (one per assistant turn), each a
//! policy [`Segment`] (loss mask 1) plus an optional observation segment (loss mask 0). A segment may carry the
//! exact token ids that produced it: policy ids come from the generator, observation ids are tokenized once,
//! on their own, by [`Trajectory::tokenize_observations`]; the transcript is never re-tokenized as a whole.
//! [`Trajectory::ids_and_loss_mask`] concatenates the ids and the mask.
//!
//! Model text is untrusted: every function here accepts any string (empty, huge, malformed tags) without
//! panicking.

use serde::{Deserialize, Serialize};

use crate::Error;

/// `<search>`.
pub const SEARCH_OPEN: &str = "<search>";
/// `</search>`.
pub const SEARCH_CLOSE: &str = "</search>";
/// `<answer>`.
pub const ANSWER_OPEN: &str = crate::answer::ANSWER_OPEN;
/// `</answer>`.
pub const ANSWER_CLOSE: &str = crate::answer::ANSWER_CLOSE;
/// `<information>`.
pub const INFO_OPEN: &str = "<information>";
/// `</information>`.
pub const INFO_CLOSE: &str = "</information>";
/// `<think>`.
pub const THINK_OPEN: &str = "<think>";
/// `</think>`.
pub const THINK_CLOSE: &str = "</think>";

/// Generation of one assistant turn stops at the first of these strings.
pub const STOP_STRINGS: [&str; 2] = [SEARCH_CLOSE, ANSWER_CLOSE];

/// The fixed observation appended after a turn with neither a search nor an answer (same content and role as
/// Search-R1's invalid-action message).
pub const INVALID_ACTION_OBSERVATION: &str = "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n";

/// Default agent prompt (Search-R1's instructions in our own words). `{question}` is replaced by the question.
pub const SEARCH_R1_TEMPLATE: &str = "Answer the given question. Every time you receive new information, you must first reason about it inside <think> and </think>. After reasoning, if you are missing some knowledge, you may call a search engine by writing <search> query </search>; the top search results will then be returned between <information> and </information>. You may search as many times as you want. When you need no further external knowledge, give the answer directly inside <answer> and </answer>, without any explanation. For example, <answer> Beijing </answer>. Question: {question}\n";

/// Prompt of the `direct` baseline (no retrieval).
pub const DIRECT_TEMPLATE: &str = "Answer the given question. Reason about it inside <think> and </think>, then give the answer directly inside <answer> and </answer>, without any explanation. For example, <answer> Beijing </answer>. Question: {question}\n";

/// Prompt of the `rag` baseline (one retrieval with the question). `{context}` is replaced by the formatted
/// passages ([`format_documents`]).
pub const RAG_TEMPLATE: &str = "Answer the given question using the retrieved documents below. Reason about it inside <think> and </think>, then give the answer directly inside <answer> and </answer>, without any explanation. For example, <answer> Beijing </answer>.\nDocuments:\n{context}\nQuestion: {question}\n";

/// A prompt template with a `{question}` placeholder (and `{context}` for RAG).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PromptTemplate(pub String);

impl Default for PromptTemplate {
    fn default() -> Self {
        PromptTemplate(SEARCH_R1_TEMPLATE.to_string())
    }
}

impl PromptTemplate {
    /// The agent template ([`SEARCH_R1_TEMPLATE`]).
    pub fn search_r1() -> Self {
        Self::default()
    }

    /// The direct-answer baseline template.
    pub fn direct() -> Self {
        PromptTemplate(DIRECT_TEMPLATE.to_string())
    }

    /// The retrieve-once baseline template.
    pub fn rag() -> Self {
        PromptTemplate(RAG_TEMPLATE.to_string())
    }

    /// Checks that the template contains `{question}`.
    pub fn validate(&self) -> Result<(), Error> {
        if self.0.contains("{question}") {
            Ok(())
        } else {
            Err(Error::Invalid(format!(
                "prompt template has no {{question}} placeholder: {:?}",
                self.0
            )))
        }
    }

    /// The template with `{question}` replaced (the question is inserted verbatim, once).
    pub fn render(&self, question: &str) -> String {
        self.render_with_context(question, "")
    }

    /// The template with `{question}` and `{context}` replaced. Placeholders inside the inserted question or
    /// context are not expanded again.
    pub fn render_with_context(&self, question: &str, context: &str) -> String {
        let mut out = String::with_capacity(self.0.len() + question.len() + context.len());
        let mut rest = self.0.as_str();
        loop {
            let q = rest.find("{question}");
            let c = rest.find("{context}");
            let (at, len, val) = match (q, c) {
                (Some(q), Some(c)) if c < q => (c, "{context}".len(), context),
                (Some(q), _) => (q, "{question}".len(), question),
                (None, Some(c)) => (c, "{context}".len(), context),
                (None, None) => break,
            };
            out.push_str(&rest[..at]);
            out.push_str(val);
            rest = &rest[at + len..];
        }
        out.push_str(rest);
        out
    }
}

/// The prompts of every role the actor plays: the agent (Search-R1 protocol) and the two baselines of the
/// evaluation table (direct answer, retrieve-once RAG). Training, the warm start and every evaluation take
/// their prompts from one value, so an instruct model trained inside its chat template is evaluated inside it
/// too ([`PromptTemplates::map`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTemplates {
    /// The agent prompt ([`PromptTemplate::search_r1`]).
    pub agent: PromptTemplate,
    /// The direct-answer baseline ([`PromptTemplate::direct`]).
    pub direct: PromptTemplate,
    /// The retrieve-once baseline ([`PromptTemplate::rag`], with `{context}`).
    pub rag: PromptTemplate,
}

impl Default for PromptTemplates {
    fn default() -> Self {
        Self::plain()
    }
}

impl PromptTemplates {
    /// The bare templates (no chat framing).
    pub fn plain() -> Self {
        PromptTemplates {
            agent: PromptTemplate::search_r1(),
            direct: PromptTemplate::direct(),
            rag: PromptTemplate::rag(),
        }
    }

    /// Every template passed through `wrap` (e.g. a tokenizer's chat template around the user message; the
    /// placeholders survive the wrapping, so questions and passages are inserted afterwards).
    pub fn map(self, mut wrap: impl FnMut(&str) -> String) -> Self {
        PromptTemplates {
            agent: PromptTemplate(wrap(&self.agent.0)),
            direct: PromptTemplate(wrap(&self.direct.0)),
            rag: PromptTemplate(wrap(&self.rag.0)),
        }
    }

    /// Checks every template (each needs `{question}`; the RAG one `{context}` too).
    pub fn validate(&self) -> Result<(), Error> {
        self.agent.validate()?;
        self.direct.validate()?;
        self.rag.validate()?;
        if !self.rag.0.contains("{context}") {
            return Err(Error::Invalid(format!(
                "the RAG prompt template has no {{context}} placeholder: {:?}",
                self.rag.0
            )));
        }
        Ok(())
    }
}

/// One retrieved passage (same fields as `kiln_retrieval::Passage`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Passage {
    /// Passage id from the corpus.
    pub id: String,
    /// Title (may be empty).
    pub title: String,
    /// Passage text.
    pub text: String,
    /// Retrieval score.
    #[serde(default)]
    pub score: f32,
}

/// `Doc 1(Title: t) text\nDoc 2(Title: t) text` (no trailing newline), Search-R1's passage list.
pub fn format_documents(passages: &[Passage]) -> String {
    let mut s = String::new();
    for (i, p) in passages.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        s.push_str(&format!("Doc {}(Title: {}) {}", i + 1, p.title, p.text));
    }
    s
}

/// The observation appended after a search: `\n\n<information>DOCS</information>\n\n`.
pub fn format_observation(passages: &[Passage]) -> String {
    format!(
        "\n\n{INFO_OPEN}{}{INFO_CLOSE}\n\n",
        format_documents(passages)
    )
}

/// Which stop string ended a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopTag {
    /// `</search>`.
    Search,
    /// `</answer>`.
    Answer,
}

/// Finds the first stop string: `(byte offset just past it, which one)`.
pub fn find_stop(text: &str) -> Option<(usize, StopTag)> {
    let s = text.find(SEARCH_CLOSE).map(|i| (i, StopTag::Search));
    let a = text.find(ANSWER_CLOSE).map(|i| (i, StopTag::Answer));
    let (at, tag) = match (s, a) {
        (Some(s), Some(a)) => {
            if s.0 < a.0 {
                s
            } else {
                a
            }
        }
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => return None,
    };
    let len = match tag {
        StopTag::Search => SEARCH_CLOSE.len(),
        StopTag::Answer => ANSWER_CLOSE.len(),
    };
    Some((at + len, tag))
}

/// The action of one assistant turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "value")]
pub enum Action {
    /// `<search> query </search>` (query trimmed, protocol tags removed, at most `max_query_chars`).
    Search(String),
    /// `<answer> answer </answer>` (trimmed).
    Answer(String),
    /// Neither tag pair, or an empty query.
    Invalid,
}

/// One parsed assistant turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedTurn<'a> {
    /// The turn text up to and including the first stop string (the whole text if there is none).
    pub kept: &'a str,
    /// Whether text after the stop string was cut.
    pub truncated: bool,
    /// The action.
    pub action: Action,
}

/// Cuts `s` to at most `max` characters (on a char boundary).
fn cut_chars(s: &mut String, max: usize) {
    if let Some((i, _)) = s.char_indices().nth(max) {
        s.truncate(i);
    }
}

/// Removes protocol tags from a query and collapses whitespace.
fn clean_query(q: &str, max_chars: usize) -> String {
    let mut s = q.to_string();
    for tag in [
        SEARCH_OPEN,
        SEARCH_CLOSE,
        ANSWER_OPEN,
        ANSWER_CLOSE,
        INFO_OPEN,
        INFO_CLOSE,
        THINK_OPEN,
        THINK_CLOSE,
    ] {
        if s.contains(tag) {
            s = s.replace(tag, " ");
        }
    }
    let mut out = String::with_capacity(s.len().min(max_chars.saturating_mul(4)));
    let mut n = 0usize;
    for word in s.split_whitespace() {
        let need = word.chars().count() + usize::from(n > 0);
        if n + need > max_chars {
            // Cut the word at the remaining budget (whole chars).
            let room = max_chars.saturating_sub(n + usize::from(n > 0));
            if room > 0 {
                if n > 0 {
                    out.push(' ');
                }
                out.extend(word.chars().take(room));
            }
            break;
        }
        if n > 0 {
            out.push(' ');
        }
        out.push_str(word);
        n += need;
    }
    out
}

/// Parses one assistant turn: cut after the first `</search>` or `</answer>`; the content is taken from the first
/// matching opening tag before it (as Search-R1's `<(search|answer)>(.*?)</\1>` does). An answer is trimmed; a
/// query is cleaned of protocol tags, whitespace-collapsed and limited to `max_query_chars` characters; an empty
/// query is [`Action::Invalid`].
pub fn parse_turn(text: &str, max_query_chars: usize) -> ParsedTurn<'_> {
    let Some((end, tag)) = find_stop(text) else {
        return ParsedTurn {
            kept: text,
            truncated: false,
            action: Action::Invalid,
        };
    };
    let kept = &text[..end];
    let (open, close) = match tag {
        StopTag::Search => (SEARCH_OPEN, SEARCH_CLOSE),
        StopTag::Answer => (ANSWER_OPEN, ANSWER_CLOSE),
    };
    let body_end = end - close.len();
    let action = match kept[..body_end].find(open) {
        None => Action::Invalid,
        Some(o) => {
            let body = &kept[o + open.len()..body_end];
            match tag {
                StopTag::Answer => Action::Answer(body.trim().to_string()),
                StopTag::Search => {
                    let q = clean_query(body, max_query_chars);
                    if q.is_empty() {
                        Action::Invalid
                    } else {
                        Action::Search(q)
                    }
                }
            }
        }
    };
    ParsedTurn {
        kept,
        truncated: end < text.len(),
        action,
    }
}

/// Who produced a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentKind {
    /// Generated by the policy: trained on (loss mask 1).
    Policy,
    /// Inserted by the environment (search results, invalid-action message): loss mask 0.
    Observation,
}

/// A piece of the response text, with its exact token ids once known.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Policy or observation.
    pub kind: SegmentKind,
    /// The text. For a policy segment with `token_ids`, this is exactly the decoding of those ids.
    pub text: String,
    /// Exact token ids (policy: as generated; observation: tokenized once, on its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// Log-probabilities of `token_ids` under the sampling policy (policy segments, when the generator gives them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f32>>,
}

impl Segment {
    /// A policy segment.
    pub fn policy(text: impl Into<String>) -> Self {
        Segment {
            kind: SegmentKind::Policy,
            text: text.into(),
            token_ids: None,
            logprobs: None,
        }
    }

    /// An observation segment.
    pub fn observation(text: impl Into<String>) -> Self {
        Segment {
            kind: SegmentKind::Observation,
            text: text.into(),
            token_ids: None,
            logprobs: None,
        }
    }

    /// The loss-mask value of every token of this segment.
    pub fn mask_value(&self) -> f32 {
        match self.kind {
            SegmentKind::Policy => 1.0,
            SegmentKind::Observation => 0.0,
        }
    }
}

/// One search call of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchCall {
    /// The query sent.
    pub query: String,
    /// The passages returned (empty if the search failed).
    pub passages: Vec<Passage>,
}

/// One assistant turn with what the environment answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The generated text (loss mask 1).
    pub policy: Segment,
    /// The parsed action.
    pub action: Action,
    /// The search this step ran, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search: Option<SearchCall>,
    /// The observation appended after this step (search results or the invalid-action message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation: Option<Segment>,
}

/// Why an episode ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "detail")]
pub enum EndReason {
    /// The policy answered.
    Answered,
    /// The policy searched on the last (search-disabled) turn.
    SearchOnLastTurn,
    /// The last turn had neither a search nor an answer.
    NoAnswer,
    /// The search backend failed for this episode (with [`crate::rollout::OnSearchError::EndEpisode`]).
    SearchFailed(String),
}

/// A prompt and the response built so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// The rendered prompt (not trained on).
    pub prompt: String,
    /// The prompt's token ids, when the caller tokenized it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// The assistant turns in order.
    pub steps: Vec<Step>,
}

impl Trajectory {
    /// A trajectory with a prompt and no steps.
    pub fn new(prompt: impl Into<String>) -> Self {
        Trajectory {
            prompt: prompt.into(),
            prompt_token_ids: None,
            steps: Vec::new(),
        }
    }

    /// The response segments in order (policy, observation, policy, ...).
    pub fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.steps
            .iter()
            .flat_map(|s| std::iter::once(&s.policy).chain(s.observation.as_ref()))
    }

    /// The response segments, mutably.
    pub fn segments_mut(&mut self) -> impl Iterator<Item = &mut Segment> {
        self.steps
            .iter_mut()
            .flat_map(|s| std::iter::once(&mut s.policy).chain(s.observation.as_mut()))
    }

    /// The response text (all segments concatenated).
    pub fn response_text(&self) -> String {
        self.segments().map(|s| s.text.as_str()).collect()
    }

    /// Prompt followed by the response.
    pub fn full_text(&self) -> String {
        let mut s = self.prompt.clone();
        s.push_str(&self.response_text());
        s
    }

    /// The queries searched, in order.
    pub fn searches(&self) -> Vec<&SearchCall> {
        self.steps
            .iter()
            .filter_map(|s| s.search.as_ref())
            .collect()
    }

    /// The answer of the final step, if it answered (the reward uses [`crate::answer::extract_answer`] on the
    /// response text, which agrees whenever the policy answered).
    pub fn final_answer(&self) -> Option<&str> {
        match self.steps.last().map(|s| &s.action) {
            Some(Action::Answer(a)) => Some(a),
            _ => None,
        }
    }

    /// Tokenizes every observation segment that has no ids yet, each on its own (token-in/token-out: the
    /// transcript is never re-tokenized).
    pub fn tokenize_observations(&mut self, mut tokenize: impl FnMut(&str) -> Vec<u32>) {
        for seg in self.segments_mut() {
            if seg.kind == SegmentKind::Observation && seg.token_ids.is_none() {
                seg.token_ids = Some(tokenize(&seg.text));
            }
        }
    }

    /// Tokenizes every segment without ids, policy segments included. Only for text-only trajectories such as
    /// scripted demonstrations (supervised warm-start); sampled trajectories keep the generator's ids.
    pub fn tokenize_missing(&mut self, mut tokenize: impl FnMut(&str) -> Vec<u32>) {
        for seg in self.segments_mut() {
            if seg.token_ids.is_none() {
                seg.token_ids = Some(tokenize(&seg.text));
            }
        }
    }

    /// The response token ids and their loss mask (1 for policy tokens, 0 for observation tokens). Every segment
    /// must carry ids.
    pub fn ids_and_loss_mask(&self) -> Result<(Vec<u32>, Vec<f32>), Error> {
        ids_and_loss_mask(self.segments())
    }
}

/// Concatenated token ids and loss mask of segments; an error names the first segment without ids.
pub fn ids_and_loss_mask<'a>(
    segments: impl IntoIterator<Item = &'a Segment>,
) -> Result<(Vec<u32>, Vec<f32>), Error> {
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for (i, seg) in segments.into_iter().enumerate() {
        let Some(t) = &seg.token_ids else {
            return Err(Error::Invalid(format!(
                "segment {i} ({:?}) has no token ids; tokenize observations with Trajectory::tokenize_observations \
                 and keep the generator's ids for policy segments",
                seg.kind
            )));
        };
        ids.extend_from_slice(t);
        mask.extend(std::iter::repeat_n(seg.mask_value(), t.len()));
    }
    Ok((ids, mask))
}

/// Loss mask of segments whose ids are not attached yet, tokenizing each segment on its own with `tokenize`
/// (ids already attached are used as they are).
pub fn loss_mask<'a>(
    segments: impl IntoIterator<Item = &'a Segment>,
    mut tokenize: impl FnMut(&str) -> Vec<u32>,
) -> Vec<f32> {
    let mut mask = Vec::new();
    for seg in segments {
        let n = match &seg.token_ids {
            Some(t) => t.len(),
            None => tokenize(&seg.text).len(),
        };
        mask.extend(std::iter::repeat_n(seg.mask_value(), n));
    }
    mask
}

/// Protocol settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ProtocolConfig {
    /// Assistant turns per episode, the last one without search (default 4).
    pub max_turns: usize,
    /// Passages per search (default 3).
    pub top_k: usize,
    /// Longer queries are cut to this many characters (default 512).
    pub max_query_chars: usize,
    /// Passage texts longer than this many characters are cut in the observation (default 4096; titles are cut
    /// at 256). Guards against a retriever returning huge garbage; real passages are far shorter.
    pub max_passage_chars: usize,
}

impl Default for ProtocolConfig {
    fn default() -> Self {
        ProtocolConfig {
            max_turns: 4,
            top_k: 3,
            max_query_chars: 512,
            max_passage_chars: 4096,
        }
    }
}

impl ProtocolConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_turns == 0 {
            return Err(Error::Invalid(
                "protocol.max_turns must be at least 1".into(),
            ));
        }
        if self.max_query_chars == 0 {
            return Err(Error::Invalid(
                "protocol.max_query_chars must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// What an episode waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pending {
    /// The policy must generate assistant turn `turn` (1-based).
    Generate {
        /// 1-based turn number.
        turn: usize,
        /// False on the last turn.
        search_enabled: bool,
    },
    /// The environment must run this query and call [`Episode::push_search_results`].
    Search {
        /// The query.
        query: String,
    },
    /// The episode is over.
    Done(EndReason),
}

/// One generated assistant turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Generated {
    /// The generated text. Without `token_ids` it is cut after the first stop string. With `token_ids` it must
    /// be the exact decoding of those ids and is kept as is: the generator is responsible for stopping at the
    /// stop string (at most the rest of the token that completed it follows).
    pub text: String,
    /// Exact generated token ids.
    pub token_ids: Option<Vec<u32>>,
    /// Their sampling log-probabilities.
    pub logprobs: Option<Vec<f32>>,
}

impl Generated {
    /// Text only (tests, scripted policies).
    pub fn text(text: impl Into<String>) -> Self {
        Generated {
            text: text.into(),
            token_ids: None,
            logprobs: None,
        }
    }
}

/// One multi-turn rollout: the state machine of the protocol.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    /// Settings.
    pub config: ProtocolConfig,
    /// Prompt and steps so far.
    pub trajectory: Trajectory,
    /// How many refiner revisions produced this episode (0 for a fresh one).
    pub revisions: usize,
    pending: Pending,
}

impl Episode {
    /// A fresh episode for an already rendered prompt.
    pub fn new(prompt: impl Into<String>, config: ProtocolConfig) -> Result<Self, Error> {
        config.validate()?;
        Ok(Episode {
            pending: Pending::Generate {
                turn: 1,
                search_enabled: config.max_turns > 1,
            },
            config,
            trajectory: Trajectory::new(prompt),
            revisions: 0,
        })
    }

    /// A fresh episode for `question` with `template`.
    pub fn for_question(
        template: &PromptTemplate,
        question: &str,
        config: ProtocolConfig,
    ) -> Result<Self, Error> {
        Self::new(template.render(question), config)
    }

    /// What the episode waits for.
    pub fn pending(&self) -> &Pending {
        &self.pending
    }

    /// True once the episode is over.
    pub fn is_done(&self) -> bool {
        matches!(self.pending, Pending::Done(_))
    }

    /// Why it ended, once over.
    pub fn end_reason(&self) -> Option<&EndReason> {
        match &self.pending {
            Pending::Done(r) => Some(r),
            _ => None,
        }
    }

    /// The text the policy continues from: prompt + response so far.
    pub fn context_text(&self) -> String {
        self.trajectory.full_text()
    }

    /// The token ids the policy continues from (prompt ids + every segment's ids), if all are known.
    pub fn context_token_ids(&self) -> Option<Vec<u32>> {
        let mut ids = self.trajectory.prompt_token_ids.clone()?;
        for seg in self.trajectory.segments() {
            ids.extend_from_slice(seg.token_ids.as_ref()?);
        }
        Some(ids)
    }

    fn next_turn(&self) -> Pending {
        let turn = self.trajectory.steps.len() + 1;
        Pending::Generate {
            turn,
            search_enabled: turn < self.config.max_turns,
        }
    }

    /// Records the policy's output for the pending turn and advances.
    pub fn push_generation(&mut self, generated: Generated) -> Result<&Pending, Error> {
        let Pending::Generate { turn, .. } = self.pending else {
            return Err(Error::Invalid(format!(
                "push_generation while the episode waits for {:?}",
                self.pending
            )));
        };
        let last = turn >= self.config.max_turns;
        let parsed = parse_turn(&generated.text, self.config.max_query_chars);
        let action = parsed.action.clone();
        let kept = parsed.kept.len();
        let mut text = generated.text;
        if generated.token_ids.is_none() {
            text.truncate(kept);
        }
        let policy = Segment {
            kind: SegmentKind::Policy,
            text,
            token_ids: generated.token_ids,
            logprobs: generated.logprobs,
        };
        let mut step = Step {
            policy,
            action: action.clone(),
            search: None,
            observation: None,
        };
        self.pending = match action {
            Action::Answer(_) => Pending::Done(EndReason::Answered),
            Action::Search(_) if last => Pending::Done(EndReason::SearchOnLastTurn),
            Action::Search(q) => Pending::Search { query: q },
            Action::Invalid if last => Pending::Done(EndReason::NoAnswer),
            Action::Invalid => {
                step.observation = Some(Segment::observation(INVALID_ACTION_OBSERVATION));
                Pending::Generate {
                    turn: turn + 1,
                    search_enabled: turn + 1 < self.config.max_turns,
                }
            }
        };
        self.trajectory.steps.push(step);
        Ok(&self.pending)
    }

    /// Records the passages returned for the pending search (at most `top_k` are kept) and advances.
    pub fn push_search_results(&mut self, mut passages: Vec<Passage>) -> Result<&Pending, Error> {
        let Pending::Search { query } = &self.pending else {
            return Err(Error::Invalid(format!(
                "push_search_results while the episode waits for {:?}",
                self.pending
            )));
        };
        passages.truncate(self.config.top_k);
        for p in &mut passages {
            cut_chars(&mut p.text, self.config.max_passage_chars);
            cut_chars(&mut p.title, 256);
        }
        let query = query.clone();
        let obs = format_observation(&passages);
        let step = self
            .trajectory
            .steps
            .last_mut()
            .ok_or_else(|| Error::Invalid("search pending without a step".into()))?;
        step.search = Some(SearchCall { query, passages });
        step.observation = Some(Segment::observation(obs));
        self.pending = self.next_turn();
        Ok(&self.pending)
    }

    /// Ends the episode because its search failed (the step keeps its query with no passages).
    pub fn fail_search(&mut self, msg: impl Into<String>) -> Result<&Pending, Error> {
        let Pending::Search { query } = &self.pending else {
            return Err(Error::Invalid(format!(
                "fail_search while the episode waits for {:?}",
                self.pending
            )));
        };
        let query = query.clone();
        if let Some(step) = self.trajectory.steps.last_mut() {
            step.search = Some(SearchCall {
                query,
                passages: Vec::new(),
            });
        }
        self.pending = Pending::Done(EndReason::SearchFailed(msg.into()));
        Ok(&self.pending)
    }

    /// A new episode that keeps steps `1..j-1` with their observations byte for byte and waits for the policy to
    /// regenerate step `j` (1-based, `1 <= j <= steps`). Its `revisions` is one more than this one's.
    pub fn cut_before_step(&self, j: usize) -> Result<Episode, Error> {
        let t = self.trajectory.steps.len();
        if j == 0 || j > t {
            return Err(Error::Invalid(format!(
                "cut step {j} is outside 1..={t} (the trajectory has {t} steps)"
            )));
        }
        let mut trajectory = self.trajectory.clone();
        trajectory.steps.truncate(j - 1);
        let mut ep = Episode {
            config: self.config.clone(),
            trajectory,
            revisions: self.revisions + 1,
            pending: Pending::Done(EndReason::NoAnswer),
        };
        ep.pending = ep.next_turn();
        Ok(ep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_renders_once_and_verbatim() {
        let t = PromptTemplate::default();
        t.validate().unwrap();
        let p = t.render("Who is {context}?");
        assert!(p.ends_with("Question: Who is {context}?\n"));
        assert!(p.contains("<search> query </search>"));
        let r = PromptTemplate::rag().render_with_context("Q?", "Doc 1(Title: A) x");
        assert!(r.contains("Documents:\nDoc 1(Title: A) x\nQuestion: Q?\n"));
        assert!(PromptTemplate("no placeholder".into()).validate().is_err());
    }

    #[test]
    fn observation_format() {
        let ps = vec![
            Passage {
                id: "1".into(),
                title: "Paris".into(),
                text: "Paris is the capital of France.".into(),
                score: 1.0,
            },
            Passage {
                id: "2".into(),
                title: "Lyon".into(),
                text: "Lyon is a city.".into(),
                score: 0.5,
            },
        ];
        assert_eq!(
            format_observation(&ps),
            "\n\n<information>Doc 1(Title: Paris) Paris is the capital of France.\nDoc 2(Title: Lyon) Lyon is a city.</information>\n\n"
        );
        assert_eq!(
            format_observation(&[]),
            "\n\n<information></information>\n\n"
        );
    }

    #[test]
    fn parse_turn_table() {
        let s = |q: &str| Action::Search(q.to_string());
        let a = |q: &str| Action::Answer(q.to_string());
        let cases: Vec<(&str, &str, Action)> = vec![
            (
                "<think>x</think><search> capital of France </search>",
                "<think>x</think><search> capital of France </search>",
                s("capital of France"),
            ),
            (
                "<answer> Paris </answer> and more",
                "<answer> Paris </answer>",
                a("Paris"),
            ),
            (
                "<answer>Paris</answer>",
                "<answer>Paris</answer>",
                a("Paris"),
            ),
            ("just text", "just text", Action::Invalid),
            ("", "", Action::Invalid),
            ("<search></search>", "<search></search>", Action::Invalid),
            (
                "<search>   </search>",
                "<search>   </search>",
                Action::Invalid,
            ),
            ("</search><search>q</search>", "</search>", Action::Invalid),
            ("no open</answer>", "no open</answer>", Action::Invalid),
            // First stop string wins, whichever it is.
            (
                "<search>q1</search><answer>a</answer>",
                "<search>q1</search>",
                s("q1"),
            ),
            (
                "<answer>a</answer><search>q1</search>",
                "<answer>a</answer>",
                a("a"),
            ),
            // <search> inside <answer>: the search closes first.
            (
                "<answer> x <search> y </search> </answer>",
                "<answer> x <search> y </search>",
                s("y"),
            ),
            // Nested/duplicated open tags: content from the first open, tags removed.
            (
                "<search>a <search> b</search>",
                "<search>a <search> b</search>",
                s("a b"),
            ),
            (
                "<answer>a<answer>b</answer>",
                "<answer>a<answer>b</answer>",
                a("a<answer>b"),
            ),
            (
                "<search>multi\n line\tquery</search>",
                "<search>multi\n line\tquery</search>",
                s("multi line query"),
            ),
            ("<SEARCH>x</SEARCH>", "<SEARCH>x</SEARCH>", Action::Invalid),
            (
                "<search>unterminated",
                "<search>unterminated",
                Action::Invalid,
            ),
            ("<answer></answer>", "<answer></answer>", a("")),
        ];
        for (text, kept, action) in cases {
            let p = parse_turn(text, 512);
            assert_eq!(p.kept, kept, "text {text:?}");
            assert_eq!(p.action, action, "text {text:?}");
            assert_eq!(p.truncated, kept.len() < text.len());
        }
    }

    #[test]
    fn huge_and_unicode_queries_are_bounded() {
        let big = format!("<search>{}</search>", "é".repeat(10_000));
        match parse_turn(&big, 512).action {
            Action::Search(q) => assert_eq!(q.chars().count(), 512),
            other => panic!("{other:?}"),
        }
        let words = format!("<search>{}</search>", "ab ".repeat(5_000));
        match parse_turn(&words, 512).action {
            Action::Search(q) => assert!(q.chars().count() <= 512 && q.starts_with("ab ab")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn episode_state_machine() {
        let cfg = ProtocolConfig::default();
        let mut ep = Episode::new("P", cfg).unwrap();
        assert_eq!(
            ep.pending(),
            &Pending::Generate {
                turn: 1,
                search_enabled: true
            }
        );
        assert!(ep.push_search_results(vec![]).is_err());
        ep.push_generation(Generated::text("<search>q</search>junk"))
            .unwrap();
        assert_eq!(ep.pending(), &Pending::Search { query: "q".into() });
        assert!(ep.push_generation(Generated::text("x")).is_err());
        ep.push_search_results(vec![Passage::default(); 5]).unwrap();
        // (huge passages are cut: see huge_passages_are_cut)
        assert_eq!(
            ep.trajectory.steps[0]
                .search
                .as_ref()
                .unwrap()
                .passages
                .len(),
            3
        );
        ep.push_generation(Generated::text("oops")).unwrap();
        assert_eq!(
            ep.trajectory.steps[1].observation.as_ref().unwrap().text,
            INVALID_ACTION_OBSERVATION
        );
        ep.push_generation(Generated::text("<search>q2</search>"))
            .unwrap();
        ep.push_search_results(vec![]).unwrap();
        assert_eq!(
            ep.pending(),
            &Pending::Generate {
                turn: 4,
                search_enabled: false
            }
        );
        ep.push_generation(Generated::text("<search>q3</search>"))
            .unwrap();
        assert_eq!(ep.end_reason(), Some(&EndReason::SearchOnLastTurn));
        assert!(ep.push_generation(Generated::text("x")).is_err());
        assert_eq!(ep.trajectory.steps.len(), 4);
        assert!(ep.trajectory.steps[3].observation.is_none());
        assert_eq!(
            ep.trajectory.response_text(),
            "<search>q</search>\n\n<information>Doc 1(Title: ) \nDoc 2(Title: ) \nDoc 3(Title: ) </information>\n\noops"
                .to_string()
                + INVALID_ACTION_OBSERVATION
                + "<search>q2</search>\n\n<information></information>\n\n<search>q3</search>"
        );
    }

    #[test]
    fn huge_passages_are_cut() {
        let mut ep = Episode::new("P", ProtocolConfig::default()).unwrap();
        ep.push_generation(Generated::text("<search>q</search>"))
            .unwrap();
        let p = Passage {
            id: "x".into(),
            title: "t".repeat(1000),
            text: "é".repeat(1_000_000),
            score: 0.0,
        };
        ep.push_search_results(vec![p]).unwrap();
        let s = &ep.trajectory.steps[0];
        let got = &s.search.as_ref().unwrap().passages[0];
        assert_eq!(got.text.chars().count(), 4096);
        assert_eq!(got.title.len(), 256);
        assert!(s.observation.as_ref().unwrap().text.len() < 10_000);
    }

    #[test]
    fn single_turn_episode_has_search_disabled() {
        let cfg = ProtocolConfig {
            max_turns: 1,
            ..Default::default()
        };
        let mut ep = Episode::new("P", cfg).unwrap();
        assert_eq!(
            ep.pending(),
            &Pending::Generate {
                turn: 1,
                search_enabled: false
            }
        );
        ep.push_generation(Generated::text("nothing")).unwrap();
        assert_eq!(ep.end_reason(), Some(&EndReason::NoAnswer));
        assert!(
            Episode::new(
                "P",
                ProtocolConfig {
                    max_turns: 0,
                    ..Default::default()
                }
            )
            .is_err()
        );
    }

    #[test]
    fn token_ids_are_kept_as_generated() {
        let mut ep = Episode::new("P", ProtocolConfig::default()).unwrap();
        ep.trajectory.prompt_token_ids = Some(vec![7]);
        ep.push_generation(Generated {
            text: "<search>q</search>\n".into(),
            token_ids: Some(vec![1, 2, 3]),
            logprobs: Some(vec![-0.1, -0.2, -0.3]),
        })
        .unwrap();
        assert_eq!(ep.trajectory.steps[0].policy.text, "<search>q</search>\n");
        assert_eq!(ep.pending(), &Pending::Search { query: "q".into() });
        assert_eq!(ep.context_token_ids(), Some(vec![7, 1, 2, 3]));
        ep.push_search_results(vec![]).unwrap();
        assert_eq!(ep.context_token_ids(), None);
        ep.trajectory.tokenize_observations(|s| vec![99; s.len()]);
        let obs_len = "\n\n<information></information>\n\n".len();
        assert_eq!(ep.context_token_ids().unwrap().len(), 1 + 3 + obs_len);
    }
}
