//! A seeded synthetic multi-hop world: made-up countries, cities, people and companies, one short document per
//! entity, and 1-hop / 2-hop (bridge and comparison) questions whose answers are only in those documents.
//!
//! Every entity belongs to exactly one split (train / dev / test), and a question only mentions and needs
//! entities of its split, so held-out questions are about entities never seen in training: the policy has to
//! search. Entity names are new *combinations* of a shared word inventory: a pool of made-up root words (two
//! syllables each) drawn once per world, and small fixed lists of first names and kind words. A person is
//! `"{first} {root}"`, a city `"{root} {Harbor|Falls|...}"`, a country `"{root} {Republic|Kingdom|...}"`, a company
//! `"{root} {Works|Labs|...}"`; every full name is unique across the whole world. So a held-out entity is unseen
//! while its words are not (as in real text, where new names are made of known subwords): a small model can copy
//! a name it reads in a passage instead of having to know it. Facts are templated:
//! - person: `"{P} is a {occupation}. {P} was born in {city} in {year}."`
//! - city: `"{C} is a city located in {country}."`
//! - country: `"{K} is a country. Its capital is {city}."`
//! - company: `"{Co} is a {industry} company founded by {P} in {year}. {Co} is headquartered in {city}."`
//!
//! Questions (with the documents that support them, in hop order):
//! - 1-hop: birthplace / birth year of a person, country of a city, founder / headquarters of a company;
//! - bridge: birthplace or birth year of a company's founder, country of a person's birthplace, country of a
//!   company's headquarters;
//! - comparison: which of two people was born first, which of two companies was founded first.
//!
//! The world is a pure function of [`WorldConfig`] (ChaCha8 from `seed`); [`load_or_generate`] caches it under
//! `datasets/cache/synthetic/<key>/` (`corpus.jsonl` in the `{"id","title","text"}` layout kiln-retrieval
//! indexes, `train.jsonl` / `dev.jsonl` / `test.jsonl` in the Search-R1 QA layout plus a `hops` field, and
//! `params.json`). [`demonstration_turns`] writes the gold search trajectory of a question in the protocol
//! format, for a supervised warm-start; [`build_demonstrations`] runs them through a real search backend.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::data::QaExample;
use crate::protocol::{Episode, Passage, PromptTemplate, ProtocolConfig};
use crate::rollout::{OnSearchError, ScriptedPolicy, SearchBackend, run_episodes};

/// Bumped whenever the output for given parameters changes, so stale caches are never read.
pub const GENERATOR_VERSION: u32 = 2;

/// Entity and question counts of one split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SplitConfig {
    /// Countries.
    pub countries: usize,
    /// Cities (each in a country of the split).
    pub cities: usize,
    /// People (each born in a city of the split).
    pub persons: usize,
    /// Companies (each founded by a person and headquartered in a city of the split).
    pub companies: usize,
    /// Questions (fewer if the entities do not allow that many distinct ones).
    pub questions: usize,
}

/// Shares of question kinds (normalised; need not sum to 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct QuestionMix {
    /// 1-hop questions.
    pub one_hop: f64,
    /// 2-hop bridge questions.
    pub bridge: f64,
    /// 2-hop comparison questions.
    pub comparison: f64,
}

impl Default for QuestionMix {
    fn default() -> Self {
        QuestionMix {
            one_hop: 0.4,
            bridge: 0.4,
            comparison: 0.2,
        }
    }
}

/// Parameters of a world.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WorldConfig {
    /// RNG seed.
    pub seed: u64,
    /// Training split.
    pub train: SplitConfig,
    /// Development split.
    pub dev: SplitConfig,
    /// Test split.
    pub test: SplitConfig,
    /// Question kind shares (the same in every split).
    pub mix: QuestionMix,
}

impl Default for WorldConfig {
    fn default() -> Self {
        WorldConfig {
            seed: 0,
            train: SplitConfig {
                countries: 8,
                cities: 40,
                persons: 300,
                companies: 200,
                questions: 2000,
            },
            dev: SplitConfig {
                countries: 3,
                cities: 10,
                persons: 40,
                companies: 20,
                questions: 200,
            },
            test: SplitConfig {
                countries: 4,
                cities: 16,
                persons: 80,
                companies: 40,
                questions: 500,
            },
            mix: QuestionMix::default(),
        }
    }
}

impl WorldConfig {
    /// Checks that every split can hold its entities.
    pub fn validate(&self) -> Result<(), Error> {
        for (name, s) in [
            ("train", &self.train),
            ("dev", &self.dev),
            ("test", &self.test),
        ] {
            if s.questions == 0 {
                continue;
            }
            if s.countries == 0 || s.cities == 0 || s.persons < 2 || s.companies < 2 {
                return Err(Error::Invalid(format!(
                    "synthetic.{name}: need at least 1 country, 1 city, 2 persons and 2 companies for questions \
                     (got {s:?})"
                )));
            }
        }
        let m = &self.mix;
        if [m.one_hop, m.bridge, m.comparison]
            .iter()
            .any(|x| !x.is_finite() || *x < 0.0)
            || m.one_hop + m.bridge + m.comparison <= 0.0
        {
            return Err(Error::Invalid(format!(
                "synthetic.mix must be non-negative with a positive sum, got {m:?}"
            )));
        }
        Ok(())
    }
}

/// A split name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Training.
    Train,
    /// Development.
    Dev,
    /// Test.
    Test,
}

impl Split {
    /// All splits.
    pub const ALL: [Split; 3] = [Split::Train, Split::Dev, Split::Test];

    /// `train`, `dev` or `test`.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Dev => "dev",
            Split::Test => "test",
        }
    }
}

/// A corpus document in the layout kiln-retrieval indexes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Doc {
    /// Document id.
    pub id: String,
    /// Entity name.
    pub title: String,
    /// The facts.
    pub text: String,
}

/// One hop of a question's gold reasoning: what to search, which document answers it, what it tells.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hop {
    /// The query a good agent issues (an entity name).
    pub query: String,
    /// The document that holds the fact.
    pub doc_id: String,
    /// The fact, as a sentence, for the demonstration's reasoning.
    pub fact: String,
}

/// A question of the world with its gold hops.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyntheticQuestion {
    /// The QA example (`type` is `1hop`, `bridge` or `comparison`; supporting ids are the hop documents).
    #[serde(flatten)]
    pub example: QaExample,
    /// Gold hops in order.
    pub hops: Vec<Hop>,
    /// Closing sentence of the demonstration's last reasoning step.
    pub conclusion: String,
}

/// A generated world.
#[derive(Debug, Clone, PartialEq)]
pub struct World {
    /// Its parameters.
    pub config: WorldConfig,
    /// All documents of all splits.
    pub corpus: Vec<Doc>,
    /// Training questions.
    pub train: Vec<SyntheticQuestion>,
    /// Development questions.
    pub dev: Vec<SyntheticQuestion>,
    /// Test questions.
    pub test: Vec<SyntheticQuestion>,
}

impl World {
    /// Questions of a split.
    pub fn split(&self, s: Split) -> &[SyntheticQuestion] {
        match s {
            Split::Train => &self.train,
            Split::Dev => &self.dev,
            Split::Test => &self.test,
        }
    }

    /// The QA examples of a split.
    pub fn examples(&self, s: Split) -> Vec<QaExample> {
        self.split(s).iter().map(|q| q.example.clone()).collect()
    }
}

const SYLLABLES: &[&str] = &[
    "ka", "lo", "ven", "mir", "ta", "dor", "bre", "sil", "nor", "qua", "zen", "ri", "mo", "fel",
    "gan", "tis", "ur", "ba", "ler", "vo", "pel", "dra", "kin", "sa", "thor", "lu", "bex", "cor",
    "ny", "hal",
];
const FIRST_NAMES: &[&str] = &[
    "Talor", "Mira", "Oren", "Sela", "Davin", "Lusa", "Beren", "Kasi", "Noma", "Tevin", "Ilsa",
    "Rodan", "Vela", "Coril", "Anwe", "Pell",
];
/// Company name suffixes with the industry they imply.
const COMPANY_KINDS: &[(&str, &str)] = &[
    ("Works", "steel"),
    ("Labs", "research"),
    ("Group", "trading"),
    ("Foods", "food"),
    ("Motors", "automobile"),
    ("Press", "publishing"),
    ("Textiles", "textile"),
    ("Systems", "software"),
];
const OCCUPATIONS: &[&str] = &[
    "painter",
    "chemist",
    "sailor",
    "poet",
    "architect",
    "merchant",
    "astronomer",
    "composer",
];
/// Kind words of country names.
const COUNTRY_KINDS: &[&str] = &["Republic", "Kingdom", "Union", "Federation"];
/// Kind words of city names.
const CITY_KINDS: &[&str] = &[
    "Harbor", "Falls", "Ridge", "Vale", "Ford", "Haven", "Crest", "Hill",
];
/// Size of the per-world pool of root words (two syllables each; 900 are possible).
const ROOTS: usize = 120;

/// `a` or `an` before a word.
fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// Draws unique entity names as combinations of a shared word inventory.
struct Namer {
    roots: Vec<String>,
    used: HashSet<String>,
}

impl Namer {
    /// A pool of `ROOTS` distinct capitalised two-syllable words.
    fn new(rng: &mut ChaCha8Rng) -> Namer {
        let mut seen = HashSet::new();
        let mut roots = Vec::with_capacity(ROOTS);
        while roots.len() < ROOTS {
            let w: String = (0..2)
                .map(|_| *SYLLABLES.choose(rng).unwrap_or(&"ka"))
                .collect();
            let mut c = w.chars();
            let w = match c.next() {
                Some(f) => f.to_uppercase().chain(c).collect::<String>(),
                None => continue,
            };
            if seen.insert(w.clone()) {
                roots.push(w);
            }
        }
        Namer {
            roots,
            used: HashSet::new(),
        }
    }

    fn root(&self, rng: &mut ChaCha8Rng) -> String {
        self.roots
            .choose(rng)
            .cloned()
            .unwrap_or_else(|| "Kalo".into())
    }

    /// A name unused so far in the world: `"{first} {root}"` with `first` from `firsts`, or
    /// `"{root} {kind}"` with `kind` from `kinds`.
    fn name(&mut self, rng: &mut ChaCha8Rng, firsts: &[&str], kinds: &[&str]) -> String {
        for _ in 0..10_000 {
            let w = if firsts.is_empty() {
                format!(
                    "{} {}",
                    self.root(rng),
                    kinds.choose(rng).unwrap_or(&"Hill")
                )
            } else {
                format!(
                    "{} {}",
                    firsts.choose(rng).unwrap_or(&"Mira"),
                    self.root(rng)
                )
            };
            if self.used.insert(w.to_lowercase()) {
                return w;
            }
        }
        // The inventory allows ~1,000-2,000 names per kind; only absurd sizes get here: a third root word.
        loop {
            let w = format!(
                "{} {} {}",
                self.root(rng),
                self.root(rng),
                kinds.first().or(firsts.first()).unwrap_or(&"Hill")
            );
            if self.used.insert(w.to_lowercase()) {
                return w;
            }
        }
    }
}

#[derive(Clone)]
struct Person {
    name: String,
    doc: String,
    city: usize,
    year: u32,
}
#[derive(Clone)]
struct City {
    name: String,
    doc: String,
    country: usize,
}
#[derive(Clone)]
struct Company {
    name: String,
    industry: &'static str,
    doc: String,
    founder: usize,
    city: usize,
    year: u32,
}

struct SplitWorld {
    countries: Vec<(String, String)>,
    cities: Vec<City>,
    persons: Vec<Person>,
    companies: Vec<Company>,
}

fn q(
    split: Split,
    n: usize,
    kind: &str,
    question: String,
    answer: &str,
    hops: Vec<Hop>,
    conclusion: String,
) -> SyntheticQuestion {
    SyntheticQuestion {
        example: QaExample {
            id: format!("syn-{}-{n}", split.name()),
            question,
            golden_answers: vec![answer.to_string()],
            data_source: "synthetic".into(),
            supporting_passage_ids: hops.iter().map(|h| h.doc_id.clone()).collect(),
            supporting_titles: hops.iter().map(|h| h.query.clone()).collect(),
            kind: Some(kind.into()),
        },
        hops,
        conclusion,
    }
}

fn hop(query: &str, doc: &str, fact: String) -> Hop {
    Hop {
        query: query.into(),
        doc_id: doc.into(),
        fact,
    }
}

fn build_split(
    rng: &mut ChaCha8Rng,
    namer: &mut Namer,
    split: Split,
    c: &SplitConfig,
    corpus: &mut Vec<Doc>,
) -> SplitWorld {
    let tag = split.name();
    let countries: Vec<(String, String)> = (0..c.countries)
        .map(|i| {
            (
                namer.name(rng, &[], COUNTRY_KINDS),
                format!("syn-{tag}-country-{i}"),
            )
        })
        .collect();
    let cities: Vec<City> = (0..c.cities)
        .map(|i| City {
            name: namer.name(rng, &[], CITY_KINDS),
            doc: format!("syn-{tag}-city-{i}"),
            country: if c.countries == 0 { 0 } else { i % c.countries },
        })
        .collect();
    let persons: Vec<Person> = (0..c.persons)
        .map(|i| Person {
            name: namer.name(rng, FIRST_NAMES, &[]),
            doc: format!("syn-{tag}-person-{i}"),
            city: rng.random_range(0..c.cities.max(1)),
            year: rng.random_range(1700..2000),
        })
        .collect();
    let companies: Vec<Company> = (0..c.companies)
        .map(|i| {
            // The kind word fixes the industry: draw the kind first, then a unique name of that kind.
            let (suf, industry) = *COMPANY_KINDS.choose(rng).unwrap_or(&("Works", "steel"));
            let name = namer.name(rng, &[], &[suf]);
            let founder = rng.random_range(0..c.persons.max(1));
            let born = persons.get(founder).map_or(1800, |p| p.year);
            Company {
                name,
                industry,
                doc: format!("syn-{tag}-company-{i}"),
                founder,
                city: rng.random_range(0..c.cities.max(1)),
                year: born + rng.random_range(20..60),
            }
        })
        .collect();
    // Documents.
    for (i, (name, id)) in countries.iter().enumerate() {
        let capital = cities
            .iter()
            .find(|ct| ct.country == i)
            .map_or("no city".to_string(), |ct| ct.name.clone());
        corpus.push(Doc {
            id: id.clone(),
            title: name.clone(),
            text: format!("{name} is a country. Its capital is {capital}."),
        });
    }
    for ct in &cities {
        let country = countries.get(ct.country).map_or("", |k| k.0.as_str());
        corpus.push(Doc {
            id: ct.doc.clone(),
            title: ct.name.clone(),
            text: format!("{} is a city located in {country}.", ct.name),
        });
    }
    for p in &persons {
        let occ = OCCUPATIONS[(p.year as usize) % OCCUPATIONS.len()];
        let city = cities.get(p.city).map_or("", |x| x.name.as_str());
        corpus.push(Doc {
            id: p.doc.clone(),
            title: p.name.clone(),
            text: format!(
                "{n} is {} {occ}. {n} was born in {city} in {y}.",
                article(occ),
                n = p.name,
                y = p.year
            ),
        });
    }
    for co in &companies {
        let ind = co.industry;
        let founder = persons.get(co.founder).map_or("", |x| x.name.as_str());
        let city = cities.get(co.city).map_or("", |x| x.name.as_str());
        corpus.push(Doc {
            id: co.doc.clone(),
            title: co.name.clone(),
            text: format!(
                "{n} is {} {ind} company founded by {founder} in {y}. {n} is headquartered in {city}.",
                article(ind),
                n = co.name,
                y = co.year
            ),
        });
    }
    SplitWorld {
        countries,
        cities,
        persons,
        companies,
    }
}

fn split_questions(
    rng: &mut ChaCha8Rng,
    split: Split,
    w: &SplitWorld,
    c: &SplitConfig,
    mix: &QuestionMix,
) -> Vec<SyntheticQuestion> {
    if c.questions == 0 || w.persons.len() < 2 || w.companies.len() < 2 || w.cities.is_empty() {
        return Vec::new();
    }
    let city = |i: usize| &w.cities[i];
    let country = |i: usize| &w.countries[w.cities[i].country].0;
    // Candidates per kind as closures over entity indices: (kind, question, answer, hops, conclusion).
    type Cand = (String, String, Vec<Hop>, String);
    let mut one: Vec<Cand> = Vec::new();
    let mut bridge: Vec<Cand> = Vec::new();
    for p in &w.persons {
        let ct = city(p.city);
        let born = format!("{} was born in {} in {}.", p.name, ct.name, p.year);
        one.push((
            format!("In which city was {} born?", p.name),
            ct.name.clone(),
            vec![hop(&p.name, &p.doc, born.clone())],
            format!("So the answer is {}.", ct.name),
        ));
        one.push((
            format!("In which year was {} born?", p.name),
            p.year.to_string(),
            vec![hop(&p.name, &p.doc, born.clone())],
            format!("So the answer is {}.", p.year),
        ));
        let k = country(p.city);
        bridge.push((
            format!("In which country was {} born?", p.name),
            k.clone(),
            vec![
                hop(&p.name, &p.doc, born),
                hop(
                    &ct.name,
                    &ct.doc,
                    format!("{} is a city located in {k}.", ct.name),
                ),
            ],
            format!("So {} was born in {k}.", p.name),
        ));
    }
    for ct in &w.cities {
        let k = &w.countries[ct.country].0;
        one.push((
            format!("In which country is {} located?", ct.name),
            k.clone(),
            vec![hop(
                &ct.name,
                &ct.doc,
                format!("{} is a city located in {k}.", ct.name),
            )],
            format!("So the answer is {k}."),
        ));
    }
    for co in &w.companies {
        let f = &w.persons[co.founder];
        let hq = city(co.city);
        let fact = format!(
            "{} was founded by {} in {} and is headquartered in {}.",
            co.name, f.name, co.year, hq.name
        );
        one.push((
            format!("Who founded {}?", co.name),
            f.name.clone(),
            vec![hop(&co.name, &co.doc, fact.clone())],
            format!("So the answer is {}.", f.name),
        ));
        one.push((
            format!("In which city is {} headquartered?", co.name),
            hq.name.clone(),
            vec![hop(&co.name, &co.doc, fact.clone())],
            format!("So the answer is {}.", hq.name),
        ));
        let fc = city(f.city);
        let fborn = format!("{} was born in {} in {}.", f.name, fc.name, f.year);
        bridge.push((
            format!("In which city was the founder of {} born?", co.name),
            fc.name.clone(),
            vec![
                hop(&co.name, &co.doc, fact.clone()),
                hop(&f.name, &f.doc, fborn.clone()),
            ],
            format!("So the founder of {} was born in {}.", co.name, fc.name),
        ));
        bridge.push((
            format!("In which year was the founder of {} born?", co.name),
            f.year.to_string(),
            vec![
                hop(&co.name, &co.doc, fact.clone()),
                hop(&f.name, &f.doc, fborn),
            ],
            format!("So the founder of {} was born in {}.", co.name, f.year),
        ));
        let k = country(co.city);
        bridge.push((
            format!("In which country is {} headquartered?", co.name),
            k.clone(),
            vec![
                hop(&co.name, &co.doc, fact),
                hop(
                    &hq.name,
                    &hq.doc,
                    format!("{} is a city located in {k}.", hq.name),
                ),
            ],
            format!("So {} is headquartered in {k}.", co.name),
        ));
    }
    one.shuffle(rng);
    bridge.shuffle(rng);
    let total = mix.one_hop + mix.bridge + mix.comparison;
    let n_one = ((c.questions as f64) * mix.one_hop / total).round() as usize;
    let n_bridge = ((c.questions as f64) * mix.bridge / total).round() as usize;
    let n_cmp = c.questions.saturating_sub(n_one + n_bridge);
    let mut cmp: Vec<Cand> = Vec::new();
    let mut seen = HashSet::new();
    let mut attempts = 0;
    while cmp.len() < n_cmp && attempts < n_cmp * 20 + 100 {
        attempts += 1;
        if rng.random_bool(0.5) {
            let (a, b) = (
                rng.random_range(0..w.persons.len()),
                rng.random_range(0..w.persons.len()),
            );
            let (pa, pb) = (&w.persons[a], &w.persons[b]);
            if a == b || pa.year == pb.year || !seen.insert(("p", a.min(b), a.max(b))) {
                continue;
            }
            let first = if pa.year < pb.year { pa } else { pb };
            cmp.push((
                format!("Who was born first, {} or {}?", pa.name, pb.name),
                first.name.clone(),
                vec![
                    hop(
                        &pa.name,
                        &pa.doc,
                        format!("{} was born in {}.", pa.name, pa.year),
                    ),
                    hop(
                        &pb.name,
                        &pb.doc,
                        format!("{} was born in {}.", pb.name, pb.year),
                    ),
                ],
                format!("So {} was born first.", first.name),
            ));
        } else {
            let (a, b) = (
                rng.random_range(0..w.companies.len()),
                rng.random_range(0..w.companies.len()),
            );
            let (ca, cb) = (&w.companies[a], &w.companies[b]);
            if a == b || ca.year == cb.year || !seen.insert(("c", a.min(b), a.max(b))) {
                continue;
            }
            let first = if ca.year < cb.year { ca } else { cb };
            cmp.push((
                format!(
                    "Which company was founded first, {} or {}?",
                    ca.name, cb.name
                ),
                first.name.clone(),
                vec![
                    hop(
                        &ca.name,
                        &ca.doc,
                        format!("{} was founded in {}.", ca.name, ca.year),
                    ),
                    hop(
                        &cb.name,
                        &cb.doc,
                        format!("{} was founded in {}.", cb.name, cb.year),
                    ),
                ],
                format!("So {} was founded first.", first.name),
            ));
        }
    }
    let mut chosen: Vec<(&str, Cand)> = Vec::new();
    chosen.extend(one.into_iter().take(n_one).map(|c| ("1hop", c)));
    chosen.extend(bridge.into_iter().take(n_bridge).map(|c| ("bridge", c)));
    chosen.extend(cmp.into_iter().map(|c| ("comparison", c)));
    chosen.shuffle(rng);
    chosen
        .into_iter()
        .enumerate()
        .map(|(i, (kind, (question, answer, hops, conclusion)))| {
            q(split, i, kind, question, &answer, hops, conclusion)
        })
        .collect()
}

/// Generates a world (a pure function of `config`).
pub fn generate(config: &WorldConfig) -> Result<World, Error> {
    config.validate()?;
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let mut namer = Namer::new(&mut rng);
    let mut corpus = Vec::new();
    let mut out: BTreeMap<Split, Vec<SyntheticQuestion>> = BTreeMap::new();
    for split in Split::ALL {
        let c = match split {
            Split::Train => &config.train,
            Split::Dev => &config.dev,
            Split::Test => &config.test,
        };
        // One RNG stream per split for entities, another for questions: changing a question count does not
        // change the entities.
        let mut erng = ChaCha8Rng::seed_from_u64(rng.random());
        let mut qrng = ChaCha8Rng::seed_from_u64(rng.random());
        let w = build_split(&mut erng, &mut namer, split, c, &mut corpus);
        out.insert(split, split_questions(&mut qrng, split, &w, c, &config.mix));
    }
    Ok(World {
        config: config.clone(),
        corpus,
        train: out.remove(&Split::Train).unwrap_or_default(),
        dev: out.remove(&Split::Dev).unwrap_or_default(),
        test: out.remove(&Split::Test).unwrap_or_default(),
    })
}

/// The cache key of a config: 16 hex digits of FNV-1a over the generator version and the config's JSON.
pub fn cache_key(config: &WorldConfig) -> String {
    let json = serde_json::to_string(config).unwrap_or_default();
    kiln_rl::digest::fnv1a_hex(format!("v{GENERATOR_VERSION}:{json}").as_bytes())
}

/// The cache root: `$KILN_SYNTHETIC_CACHE` if set, else `datasets/cache/synthetic` (relative to the current
/// directory, i.e. the repository root).
pub fn default_cache_root() -> PathBuf {
    std::env::var_os("KILN_SYNTHETIC_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("datasets/cache/synthetic"))
}

#[derive(Serialize, Deserialize)]
struct Params {
    generator_version: u32,
    config: WorldConfig,
    corpus: usize,
    train: usize,
    dev: usize,
    test: usize,
}

fn write_jsonl<T: Serialize>(path: &Path, rows: &[T]) -> Result<(), Error> {
    let mut s = String::new();
    for r in rows {
        s.push_str(&serde_json::to_string(r).map_err(|e| Error::Invalid(e.to_string()))?);
        s.push('\n');
    }
    std::fs::write(path, s).map_err(|e| Error::io(path, e))
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::BadLine {
                path: path.to_path_buf(),
                line: i + 1,
                msg: e.to_string(),
            })
        })
        .collect()
}

impl World {
    /// Writes `corpus.jsonl`, `train.jsonl`, `dev.jsonl`, `test.jsonl` and `params.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        write_jsonl(&dir.join("corpus.jsonl"), &self.corpus)?;
        for s in Split::ALL {
            write_jsonl(&dir.join(format!("{}.jsonl", s.name())), self.split(s))?;
        }
        let params = Params {
            generator_version: GENERATOR_VERSION,
            config: self.config.clone(),
            corpus: self.corpus.len(),
            train: self.train.len(),
            dev: self.dev.len(),
            test: self.test.len(),
        };
        let p = dir.join("params.json");
        let s = serde_json::to_string_pretty(&params).map_err(|e| Error::Invalid(e.to_string()))?;
        std::fs::write(&p, s).map_err(|e| Error::io(&p, e))
    }

    /// Reads a world written by [`World::write`]; an error if the files are missing, damaged, or were made for
    /// another config or generator version.
    pub fn read(dir: &Path, config: &WorldConfig) -> Result<World, Error> {
        let p = dir.join("params.json");
        let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
        let params: Params = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid(format!("{}: {e}", p.display())))?;
        if params.generator_version != GENERATOR_VERSION || &params.config != config {
            return Err(Error::Invalid(format!(
                "{} was made for another config or generator version",
                p.display()
            )));
        }
        let w = World {
            config: config.clone(),
            corpus: read_jsonl(&dir.join("corpus.jsonl"))?,
            train: read_jsonl(&dir.join("train.jsonl"))?,
            dev: read_jsonl(&dir.join("dev.jsonl"))?,
            test: read_jsonl(&dir.join("test.jsonl"))?,
        };
        if (w.corpus.len(), w.train.len(), w.dev.len(), w.test.len())
            != (params.corpus, params.train, params.dev, params.test)
        {
            return Err(Error::Invalid(format!(
                "{}: file sizes do not match params.json (truncated cache)",
                dir.display()
            )));
        }
        Ok(w)
    }
}

/// Returns the world for `config` from `<cache_root>/<key>/` or generates and caches it there (written to a
/// temporary directory and renamed, so an interrupted run never leaves a half-written cache; a damaged or
/// mismatching cache is regenerated with a warning). Returns the world and its directory.
pub fn load_or_generate(
    config: &WorldConfig,
    cache_root: &Path,
) -> Result<(World, PathBuf), Error> {
    let dir = cache_root.join(cache_key(config));
    if dir.is_dir() {
        match World::read(&dir, config) {
            Ok(w) => return Ok((w, dir)),
            Err(e) => {
                tracing::warn!("regenerating the synthetic world: {e}");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    let world = generate(config)?;
    let tmp = cache_root.join(format!(".{}.tmp-{}", cache_key(config), std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    world.write(&tmp)?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => {}
        // Another process won the race: use its copy.
        Err(_) if dir.is_dir() => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(e) => return Err(Error::io(&dir, e)),
    }
    Ok((world, dir))
}

/// A consistent random renaming of a world's entity names: a bijection on the first names and one on the
/// name roots (`Zenpel` in `Zenpel Harbor`, `Silur Foods`, `Lusa Zenpel`), applied word by word.
///
/// Used by the warm start (`rename_copies`): within one demonstration every name is renamed the same way, so
/// the demonstration stays true to its own passages, but across copies the same question has other answers.
/// A policy can then only lower its loss by reading names off the question and the retrieved passages, not by
/// memorising the training split (which is what it does otherwise, and what makes held-out EM 0).
#[derive(Debug, Clone)]
pub struct Renamer {
    map: HashMap<String, String>,
}

impl Renamer {
    /// The name words of `world`: its first names and the roots of every entity title.
    pub fn name_words(world: &World) -> (Vec<String>, Vec<String>) {
        let firsts: Vec<String> = FIRST_NAMES.iter().map(|f| f.to_string()).collect();
        let first_set: HashSet<&str> = FIRST_NAMES.iter().copied().collect();
        let mut roots: Vec<String> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        for d in &world.corpus {
            let words: Vec<&str> = d.title.split_whitespace().collect();
            let root = match words.as_slice() {
                [first, root] if first_set.contains(first) => *root,
                [root, _kind] => *root,
                _ => continue,
            };
            if !first_set.contains(root) && seen.insert(root.to_string()) {
                roots.push(root.to_string());
            }
        }
        roots.sort();
        (firsts, roots)
    }

    /// A random renaming (uniform over the permutations of each word class).
    pub fn random(world: &World, rng: &mut ChaCha8Rng) -> Self {
        let (firsts, roots) = Self::name_words(world);
        let mut map = HashMap::new();
        for class in [firsts, roots] {
            let mut to = class.clone();
            to.shuffle(rng);
            map.extend(class.into_iter().zip(to));
        }
        Renamer { map }
    }

    /// `text` with every whole word (maximal run of alphanumerics) that is a name word replaced.
    pub fn apply(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut word = String::new();
        let flush = |word: &mut String, out: &mut String| {
            match self.map.get(word.as_str()) {
                Some(to) => out.push_str(to),
                None => out.push_str(word),
            }
            word.clear();
        };
        for c in text.chars() {
            if c.is_alphanumeric() {
                word.push(c);
            } else {
                flush(&mut word, &mut out);
                out.push(c);
            }
        }
        flush(&mut word, &mut out);
        out
    }
}

/// The gold trajectory of a question as assistant turns in the protocol format: one search per hop (the hop's
/// entity), reasoning about the fact found, then the answer.
pub fn demonstration_turns(q: &SyntheticQuestion) -> Vec<String> {
    let mut turns = Vec::with_capacity(q.hops.len() + 1);
    let mut prev: Option<&Hop> = None;
    for h in &q.hops {
        let think = match prev {
            None => format!("I need to look up {}.", h.query),
            Some(p) => format!("{} Now I need to look up {}.", p.fact, h.query),
        };
        turns.push(format!(
            "<think>{think}</think>\n<search> {} </search>",
            h.query
        ));
        prev = Some(h);
    }
    let last = prev.map_or(String::new(), |p| format!("{} ", p.fact));
    turns.push(format!(
        "<think>{last}{}</think>\n<answer> {} </answer>",
        q.conclusion,
        q.example.golden_answers.first().map_or("", String::as_str)
    ));
    turns
}

/// Runs the demonstrations of `questions` through `search` with the protocol, and keeps those whose every
/// search returned its hop's document (so the demonstration's reasoning matches what it read) and that fit in
/// `protocol.max_turns`. Returns the finished episodes (text only; tokenize with
/// [`crate::protocol::Trajectory::tokenize_missing`]) and the number dropped.
pub fn build_demonstrations(
    questions: &[SyntheticQuestion],
    template: &PromptTemplate,
    protocol: &ProtocolConfig,
    search: &dyn SearchBackend,
) -> Result<(Vec<Episode>, usize), Error> {
    let usable: Vec<&SyntheticQuestion> = questions
        .iter()
        .filter(|q| q.hops.len() < protocol.max_turns)
        .collect();
    let mut eps = usable
        .iter()
        .map(|q| Episode::for_question(template, &q.example.question, protocol.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut policy = ScriptedPolicy::new(usable.iter().map(|q| demonstration_turns(q)).collect());
    run_episodes(&mut eps, &mut policy, search, OnSearchError::EndEpisode)?;
    let mut keep = Vec::new();
    for (q, ep) in usable.iter().zip(eps) {
        let searches = ep.trajectory.searches();
        let ok = ep.trajectory.final_answer().is_some()
            && searches.len() == q.hops.len()
            && searches
                .iter()
                .zip(&q.hops)
                .all(|(s, h)| s.passages.iter().any(|p: &Passage| p.id == h.doc_id));
        if ok {
            keep.push(ep);
        }
    }
    let dropped = questions.len() - keep.len();
    Ok((keep, dropped))
}
