//! Fuzzing on stable Rust: hostile input fed to the parsers, conversions and the state
//! machine, with no compiler instrumentation (docs/FUZZING.md).
//!
//! A [`Target`] is a function from bytes to `Ok(())` or an invariant violation, with a seed
//! corpus of valid inputs and a dictionary of the format's tokens. [`run`] drives one: the
//! seeds first, then cases that are either fresh random bytes or a corpus entry mutated
//! (`mutate`), each run under `catch_unwind`. Every panic and every violation is a finding,
//! kept with its input (shrunk) and a signature that groups repeats.
//!
//! There is no coverage feedback. Instead each target reports *features* of what a case did
//! (which rejection, which outcome, which parser error), and a case that shows a feature no
//! earlier case showed joins the corpus, so later mutations start from inputs that reach
//! further. Everything is deterministic from the seed (`SplitMix64`), so a campaign replays.
//!
//! Files: `mutate` (the mutator), `bytes` (a byte reader for structured generators), `fleet`
//! (the cluster state the API targets run against), and one file per target: `request`,
//! `apply`, `topology`, `trace`, `record_log`.

mod apply;
mod bytes;
mod fleet;
mod mutate;
mod record_log;
mod request;
mod topology;
mod trace;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::scheduler::score::SplitMix64;

pub use bytes::ByteReader;

/// One fuzz target.
pub struct Target {
    pub name: &'static str,
    /// What it feeds and what it checks, in one line.
    pub about: &'static str,
    /// Longest input the mutator makes.
    pub max_len: usize,
    /// Tokens of the input format the mutator may insert.
    pub dictionary: &'static [&'static [u8]],
    /// Valid inputs to start from.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Runs one case. `Err` is a violated invariant; a panic is a crash. Errors of the code
    /// under test (a rejected request, a parse error) are `Ok`: hostile input should get them.
    pub run: fn(&[u8], &mut Features) -> Result<(), String>,
}

/// Every target, in the order `--target all` runs them.
pub const TARGETS: &[Target] = &[
    request::TARGET,
    apply::TARGET,
    topology::TARGET,
    trace::TARGET,
    record_log::TARGET,
];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// What a case did, as hashes: a case with a feature not seen before joins the corpus.
#[derive(Debug, Default)]
pub struct Features(Vec<u64>);

impl Features {
    pub fn add(&mut self, feature: impl Hash) {
        let mut h = DefaultHasher::new();
        feature.hash(&mut h);
        self.0.push(h.finish());
    }
}

/// The first `max_words` words of a message, each kept if it is a plain lowercase word (not
/// quoted) and `#` otherwise: a low-cardinality feature or signature (ids, names, paths and values differ
/// between cases that hit the same path).
pub fn shape(message: &str, max_words: usize) -> String {
    let words: Vec<&str> = message
        .split_whitespace()
        .take(max_words)
        .map(|w| {
            // Values are quoted in messages (`x`, "x"); plain words are the message's own.
            let w = w.trim_matches(|c: char| "()[]{},.;:!?".contains(c));
            let plain = !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
            if plain { w } else { "#" }
        })
        .collect();
    words.join(" ")
}

/// When to stop: whichever limit comes first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Budget {
    pub cases: Option<u64>,
    pub time: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FindingKind {
    Panic,
    Violation,
}

/// One distinct crash or violation.
#[derive(Debug, Clone)]
pub struct Finding {
    pub kind: FindingKind,
    /// Groups repeats: the panic's location, or the violation's shape.
    pub signature: String,
    pub message: String,
    /// The first input that showed it, shrunk.
    pub input: Vec<u8>,
    pub count: u64,
}

/// What one run of a target did.
#[derive(Debug, Clone)]
pub struct Report {
    pub target: &'static str,
    pub cases: u64,
    pub wall: Duration,
    /// CPU time of the whole process over the run (all threads).
    pub cpu: Duration,
    pub corpus: usize,
    pub features: usize,
    pub findings: Vec<Finding>,
    /// The slowest case and how long it took.
    pub slowest: (Duration, Vec<u8>),
}

impl Report {
    pub fn crashes(&self) -> u64 {
        self.findings.iter().map(|f| f.count).sum()
    }
}

/// Most corpus entries kept; past it a new entry replaces a random non-seed one.
const MAX_CORPUS: usize = 4096;
/// One case in this many is fresh random bytes rather than a mutation.
const FRESH_ONE_IN: u64 = 12;

/// Runs `target` from `seed` until `budget` is spent.
pub fn run(target: &Target, seed: u64, budget: Budget) -> Report {
    let _quiet = QuietPanics::install();
    let cpu_start = cpu_time();
    let start = Instant::now();
    let mut rng = SplitMix64::new(seed);
    let mut corpus: Vec<Vec<u8>> = (target.seeds)();
    let seeds = corpus.len();
    let mut seen: BTreeSet<u64> = BTreeSet::new();
    let mut findings: BTreeMap<String, Finding> = BTreeMap::new();
    let mut slowest = (Duration::ZERO, Vec::new());
    let mut cases = 0u64;
    loop {
        if budget.cases.is_some_and(|n| cases >= n)
            || budget.time.is_some_and(|t| start.elapsed() >= t)
        {
            break;
        }
        let input = if (cases as usize) < seeds {
            corpus[cases as usize].clone()
        } else if corpus.is_empty() || rng.below(FRESH_ONE_IN) == 0 {
            mutate::fresh(&mut rng, target)
        } else {
            let base = rng.below(corpus.len() as u64) as usize;
            mutate::havoc(&mut rng, target, &corpus, base)
        };
        cases += 1;
        let mut features = Features::default();
        let case_start = Instant::now();
        let result = run_one(target, &input, &mut features);
        let took = case_start.elapsed();
        if took > slowest.0 {
            slowest = (took, input.clone());
        }
        let new = features
            .0
            .iter()
            .fold(false, |new, f| seen.insert(*f) | new);
        if let Err((kind, signature, message)) = result {
            match findings.get_mut(&signature) {
                Some(f) => f.count += 1,
                None => {
                    let input = shrink(target, &input, &signature);
                    let finding = Finding {
                        kind,
                        signature: signature.clone(),
                        message,
                        input,
                        count: 1,
                    };
                    findings.insert(signature, finding);
                }
            }
        } else if new && (cases as usize) > seeds {
            if corpus.len() < MAX_CORPUS {
                corpus.push(input);
            } else {
                let slot = seeds + rng.below((MAX_CORPUS - seeds) as u64) as usize;
                corpus[slot] = input;
            }
        }
    }
    Report {
        target: target.name,
        cases,
        wall: start.elapsed(),
        cpu: cpu_time().saturating_sub(cpu_start),
        corpus: corpus.len(),
        features: seen.len(),
        findings: findings.into_values().collect(),
        slowest,
    }
}

/// One case: `Err((kind, signature, message))` for a panic or a violation.
fn run_one(
    target: &Target,
    input: &[u8],
    features: &mut Features,
) -> Result<(), (FindingKind, String, String)> {
    LAST_PANIC.with(|p| p.borrow_mut().take());
    match panic::catch_unwind(AssertUnwindSafe(|| (target.run)(input, features))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(violation)) => Err((
            FindingKind::Violation,
            format!("violation: {}", shape(&violation, 10)),
            violation,
        )),
        Err(payload) => {
            let (location, message) = LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .unwrap_or_else(|| (String::from("?"), panic_message(&*payload)));
            Err((
                FindingKind::Panic,
                format!("panic at {location}"),
                format!("panicked at {location}: {message}"),
            ))
        }
    }
}

/// A smaller input with the same signature: chunks removed, largest first, while the finding
/// stays (bounded, so a slow target does not spend its budget here).
fn shrink(target: &Target, input: &[u8], signature: &str) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut best = input.to_vec();
    let mut chunk = best.len() / 2;
    let mut tries = 0;
    while chunk > 0 && tries < 2000 && Instant::now() < deadline {
        let mut at = 0;
        let mut shrunk = false;
        while at + chunk <= best.len() && tries < 2000 {
            tries += 1;
            let mut candidate = best.clone();
            candidate.drain(at..at + chunk);
            match run_one(target, &candidate, &mut Features::default()) {
                Err((_, s, _)) if s == signature => {
                    best = candidate;
                    shrunk = true;
                }
                _ => at += chunk,
            }
        }
        if !shrunk {
            chunk /= 2;
        }
    }
    best
}

/// Runs `input` once with the panic hook left alone (so a crash prints as usual), for
/// reproducing a finding.
pub fn replay(target: &Target, input: &[u8]) -> Result<(), String> {
    (target.run)(input, &mut Features::default())
}

/// Writes each finding's input (`<target>-<n>.bin`) and a note saying what it is (`.txt`).
pub fn write_findings(report: &Report, dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    for (n, f) in report.findings.iter().enumerate() {
        let stem = dir.join(format!("{}-{n}", report.target));
        let bin = stem.with_extension("bin");
        std::fs::write(&bin, &f.input)?;
        let note = format!(
            "target: {}\nkind: {:?}\nsignature: {}\nseen: {} times\nmessage: {}\ninput ({} bytes, hex): {}\n",
            report.target,
            f.kind,
            f.signature,
            f.count,
            f.message,
            f.input.len(),
            hex(&f.input)
        );
        std::fs::write(stem.with_extension("txt"), note)?;
        written.push(bin);
    }
    Ok(written)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Panics: silenced while a run lasts, and their location kept for the finding
// ---------------------------------------------------------------------------------------------

thread_local! {
    /// (location, message) of the last panic on this thread.
    static LAST_PANIC: RefCell<Option<(String, String)>> = const { RefCell::new(None) };
}

/// The panic hook is process-wide: one run at a time replaces it.
static HOOK: Mutex<()> = Mutex::new(());

type Hook = Box<dyn Fn(&panic::PanicHookInfo<'_>) + Sync + Send + 'static>;

/// Replaces the panic hook with one that only records the panic, until dropped.
struct QuietPanics {
    previous: Option<Hook>,
    _lock: std::sync::MutexGuard<'static, ()>,
}

impl QuietPanics {
    fn install() -> QuietPanics {
        let lock = HOOK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let previous = panic::take_hook();
        panic::set_hook(Box::new(|info| {
            let location = info
                .location()
                .map_or_else(|| "?".to_owned(), |l| format!("{}:{}", l.file(), l.line()));
            let message = panic_message(info.payload());
            LAST_PANIC.with(|p| *p.borrow_mut() = Some((location, message)));
        }));
        QuietPanics {
            previous: Some(previous),
            _lock: lock,
        }
    }
}

impl Drop for QuietPanics {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            panic::set_hook(previous);
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_owned()
    }
}

/// User plus system CPU time of this process so far.
fn cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the buffer it is given and reads nothing.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return Duration::ZERO;
    }
    // SAFETY: getrusage succeeded, so it filled the struct (and zeroed() made it valid anyway).
    let usage = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}
