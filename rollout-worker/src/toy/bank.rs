//! The toy task bank: every template a toy task is made from.
//!
//! Long because it is a data table: one entry per template (a Python function with
//! placeholders, its planted mutations, an argument generator and a Rust model of its
//! behaviour), grouped by theme, plus the word lists names are drawn from.

use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::toy::python::{floordiv, li, pymod, slice_bounds, st, Py, Res};

/// The generator's random source.
pub(crate) type R = ChaCha8Rng;

/// The kinds of planted bugs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BugFamily {
    WrongOperator,
    OffByOne,
    WrongComparison,
    SwappedArguments,
    WrongConstant,
}

impl BugFamily {
    pub const ALL: [BugFamily; 5] = [
        BugFamily::WrongOperator,
        BugFamily::OffByOne,
        BugFamily::WrongComparison,
        BugFamily::SwappedArguments,
        BugFamily::WrongConstant,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BugFamily::WrongOperator => "wrong_operator",
            BugFamily::OffByOne => "off_by_one",
            BugFamily::WrongComparison => "wrong_comparison",
            BugFamily::SwappedArguments => "swapped_arguments",
            BugFamily::WrongConstant => "wrong_constant",
        }
    }

    pub fn parse(s: &str) -> Option<BugFamily> {
        BugFamily::ALL.into_iter().find(|f| f.as_str() == s)
    }
}

pub(crate) fn words_from(rng: &mut R, pool: &[&str], lo: usize, hi: usize) -> Vec<String> {
    let n = rng.gen_range(lo..=hi);
    (0..n)
        .map(|_| pool[rng.gen_range(0..pool.len())].to_string())
        .collect()
}

pub(crate) fn rand_ints(rng: &mut R, lo_len: usize, hi_len: usize, lo: i64, hi: i64) -> Vec<i64> {
    let n = rng.gen_range(lo_len..=hi_len);
    (0..n).map(|_| rng.gen_range(lo..=hi)).collect()
}

pub(crate) const WORDS: &[&str] = &[
    "apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "ocean", "pixel", "cedar",
    "amber", "delta", "frost", "grape", "honey", "ivory", "jelly", "koala", "lunar", "mango",
];

pub(crate) struct Mutation {
    pub(crate) family: BugFamily,
    /// Substring of the function source (after placeholder substitution) to replace; it
    /// occurs exactly once.
    pub(crate) find: &'static str,
    pub(crate) replace: &'static str,
    /// Optional extra sentence for the issue (placeholders allowed).
    pub(crate) symptom: &'static str,
}

pub(crate) struct Template {
    pub(crate) theme: usize,
    pub(crate) names: &'static [&'static str],
    /// Python source; `__NAME__` and `__C0__`, `__C1__`… are substituted.
    pub(crate) source: &'static str,
    /// Seed-varied constants (as Python source text).
    pub(crate) consts: fn(&mut R) -> Vec<String>,
    pub(crate) mutations: &'static [Mutation],
    /// Arguments likely to expose mutation `m` (also used, with any `m`, for plain tests).
    pub(crate) args: fn(&mut R, &[String], usize) -> Vec<Py>,
    /// The function's behaviour: correct for `None`, mutated for `Some(m)`.
    pub(crate) eval: fn(&[String], Option<usize>, &[Py]) -> Res,
}

pub(crate) fn no_consts(_: &mut R) -> Vec<String> {
    Vec::new()
}

pub(crate) fn c_int(c: &[String], i: usize) -> i64 {
    c[i].parse().expect("numeric template constant")
}

pub(crate) const THEMES: [(&str, &[&str]); 5] = [
    (
        "Small statistics helpers for lists of numbers.",
        &["stats", "series", "numeric"],
    ),
    ("String helpers.", &["text", "strings", "textutil"]),
    (
        "Time and calendar helpers.",
        &["timeutil", "clock", "calendar_util"],
    ),
    (
        "List and sequence helpers.",
        &["seqtools", "listutil", "sequences"],
    ),
    (
        "Money helpers; amounts are integer cents.",
        &["pricing", "billing", "finance"],
    ),
];

pub(crate) const PACKAGES: &[&str] = &[
    "ledger", "orchard", "quill", "harbor", "beacon", "cobalt", "tundra", "falcon", "juniper",
    "meadow", "pebble", "quartz", "summit", "willow", "zephyr", "acorn", "bramble", "cinder",
    "dune", "ember", "fjord", "glacier", "hazel", "indigo", "jasper", "kestrel", "lichen",
    "marble", "nimbus", "onyx", "prairie", "quasar", "raven", "sable", "thistle", "umber",
    "vortex", "wren", "yarrow", "alder",
];

pub(crate) static BANK: &[Template] = &[
    // ---- theme 0: stats
    Template {
        theme: 0,
        names: &["window_sums", "sliding_sums", "rolling_sums"],
        source: r#"def __NAME__(values, size):
    """Return the sum of every run of `size` consecutive values."""
    if size <= 0:
        raise ValueError("size must be positive")
    sums = []
    for start in range(len(values) - size + 1):
        sums.append(sum(values[start:start + size]))
    return sums
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::OffByOne,
                find: "range(len(values) - size + 1)",
                replace: "range(len(values) - size)",
                symptom: "The last window seems to be missing.",
            },
            Mutation {
                family: BugFamily::OffByOne,
                find: "values[start:start + size]",
                replace: "values[start:start + size - 1]",
                symptom: "Each sum seems to leave out one value of its window.",
            },
        ],
        args: |rng, _, _| {
            let v = rand_ints(rng, 4, 7, 0, 9);
            let size = rng.gen_range(2..=3);
            vec![li(v), Py::Int(size)]
        },
        eval: |_, m, a| {
            let v = a[0].ints();
            let size = a[1].int();
            let n = v.len() as i64;
            let count = if m == Some(0) { n - size } else { n - size + 1 };
            let width = if m == Some(1) { size - 1 } else { size };
            Ok(li((0..count.max(0)).map(|s| {
                let (x, y) = slice_bounds(v.len(), s, s + width);
                v[x..y].iter().sum::<i64>()
            })))
        },
    },
    Template {
        theme: 0,
        names: &["running_totals", "cumulative_sums", "prefix_sums"],
        source: r#"def __NAME__(values):
    """Return the running totals of `values`."""
    totals = []
    acc = 0
    for value in values:
        acc = acc + value
        totals.append(acc)
    return totals
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongOperator,
                find: "acc = acc + value",
                replace: "acc = acc - value",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "acc = 0",
                replace: "acc = 1",
                symptom: "Every total looks off by the same amount.",
            },
        ],
        args: |rng, _, _| vec![li(rand_ints(rng, 3, 6, 1, 9))],
        eval: |_, m, a| {
            let mut acc = if m == Some(1) { 1 } else { 0 };
            let mut out = Vec::new();
            for v in a[0].ints() {
                acc = if m == Some(0) { acc - v } else { acc + v };
                out.push(acc);
            }
            Ok(li(out))
        },
    },
    Template {
        theme: 0,
        names: &["count_above", "count_over", "num_above"],
        source: r#"def __NAME__(values, threshold):
    """Count how many values are strictly greater than `threshold`."""
    count = 0
    for value in values:
        if value > threshold:
            count += 1
    return count
"#,
        consts: no_consts,
        mutations: &[Mutation {
            family: BugFamily::WrongComparison,
            find: "if value > threshold:",
            replace: "if value >= threshold:",
            symptom: "Values equal to the threshold should not be counted.",
        }],
        args: |rng, _, _| {
            let v = rand_ints(rng, 5, 7, 0, 9);
            let t = if rng.gen_bool(0.7) {
                v[rng.gen_range(0..v.len())]
            } else {
                rng.gen_range(0..=9)
            };
            vec![li(v), Py::Int(t)]
        },
        eval: |_, m, a| {
            let t = a[1].int();
            let n = a[0]
                .ints()
                .into_iter()
                .filter(|&v| if m == Some(0) { v >= t } else { v > t })
                .count();
            Ok(Py::Int(n as i64))
        },
    },
    Template {
        theme: 0,
        names: &["value_range", "spread", "span_of"],
        source: r#"def __NAME__(values):
    """Return the largest value minus the smallest one (0 for an empty list)."""
    if not values:
        return 0
    return max(values) - min(values)
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongOperator,
                find: "max(values) - min(values)",
                replace: "max(values) + min(values)",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "return 0",
                replace: "return -1",
                symptom: "Only the empty list seems to be affected.",
            },
        ],
        args: |rng, _, m| {
            if m == 1 && rng.gen_bool(0.7) {
                return vec![li([])];
            }
            vec![li(rand_ints(rng, 3, 6, 1, 20))]
        },
        eval: |_, m, a| {
            let v = a[0].ints();
            if v.is_empty() {
                return Ok(Py::Int(if m == Some(1) { -1 } else { 0 }));
            }
            let (hi, lo) = (*v.iter().max().unwrap(), *v.iter().min().unwrap());
            Ok(Py::Int(if m == Some(0) { hi + lo } else { hi - lo }))
        },
    },
    // ---- theme 1: text
    Template {
        theme: 1,
        names: &["slugify", "make_slug", "to_slug"],
        source: r#"def __NAME__(text, sep="__C0__"):
    """Lower-case `text` and join its words with `sep`."""
    words = text.split()
    return sep.join(word.lower() for word in words)
"#,
        consts: |rng| {
            let seps = ["-", "_", "."];
            let i = rng.gen_range(0..seps.len());
            let j = (i + rng.gen_range(1..seps.len())) % seps.len();
            vec![seps[i].into(), seps[j].into()]
        },
        mutations: &[Mutation {
            family: BugFamily::WrongConstant,
            find: r#"sep="__C0__""#,
            replace: r#"sep="__C1__""#,
            symptom: "By default the words should be joined with `__C0__`.",
        }],
        args: |rng, _, _| {
            let words: Vec<String> = words_from(rng, WORDS, 1, 4)
                .into_iter()
                .map(|w| {
                    if rng.gen_bool(0.5) {
                        let mut c = w.chars();
                        let f = c.next().unwrap().to_ascii_uppercase();
                        format!("{f}{}", c.as_str())
                    } else {
                        w
                    }
                })
                .collect();
            let sep = if rng.gen_bool(0.3) { "  " } else { " " };
            vec![st(words.join(sep))]
        },
        eval: |c, m, a| {
            let sep = if m == Some(0) { &c[1] } else { &c[0] };
            let words: Vec<String> = a[0]
                .text()
                .split_whitespace()
                .map(|w| w.to_lowercase())
                .collect();
            Ok(st(words.join(sep)))
        },
    },
    Template {
        theme: 1,
        names: &["mask_secret", "mask_tail", "redact"],
        source: r#"def __NAME__(secret, visible=__C0__):
    """Replace all but the last `visible` characters of `secret` with "*"."""
    hidden = max(len(secret) - visible, 0)
    return "*" * hidden + secret[hidden:]
"#,
        consts: |rng| {
            let v = rng.gen_range(2..=5);
            let other = if rng.gen_bool(0.5) { v + 1 } else { v - 1 };
            vec![v.to_string(), other.to_string()]
        },
        mutations: &[
            Mutation {
                family: BugFamily::OffByOne,
                find: "secret[hidden:]",
                replace: "secret[hidden + 1:]",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "visible=__C0__",
                replace: "visible=__C1__",
                symptom: "By default the last __C0__ characters should stay visible.",
            },
        ],
        args: |rng, _, m| {
            let n = rng.gen_range(8..=12);
            let s: String = (0..n)
                .map(|_| char::from(b'0' + rng.gen_range(0..10u8)))
                .collect();
            if m == 0 && rng.gen_bool(0.5) {
                vec![st(s), Py::Int(rng.gen_range(2..=5))]
            } else {
                vec![st(s)]
            }
        },
        eval: |c, m, a| {
            let s = a[0].text();
            let default = if m == Some(1) {
                c_int(c, 1)
            } else {
                c_int(c, 0)
            };
            let vis = a.get(1).map_or(default, Py::int);
            let n = s.len() as i64;
            let hidden = (n - vis).max(0);
            let from = if m == Some(0) { hidden + 1 } else { hidden };
            let (x, y) = slice_bounds(s.len(), from, n);
            Ok(st(format!("{}{}", "*".repeat(hidden as usize), &s[x..y])))
        },
    },
    Template {
        theme: 1,
        names: &["truncate", "shorten", "clip_text"],
        source: r#"def __NAME__(text, limit, suffix="__C0__"):
    """Shorten `text` to at most `limit` characters, ending with `suffix` when cut."""
    if len(text) <= limit:
        return text
    return text[:limit - len(suffix)] + suffix
"#,
        consts: |rng| vec![["...", "..", "~"][rng.gen_range(0..3)].to_string()],
        mutations: &[
            Mutation {
                family: BugFamily::WrongComparison,
                find: "if len(text) <= limit:",
                replace: "if len(text) < limit:",
                symptom: "Text that already fits should be returned unchanged.",
            },
            Mutation {
                family: BugFamily::OffByOne,
                find: "text[:limit - len(suffix)]",
                replace: "text[:limit - len(suffix) + 1]",
                symptom: "The result should never be longer than `limit`.",
            },
        ],
        args: |rng, c, m| {
            let text = words_from(rng, WORDS, 2, 4).join(" ");
            let n = text.len() as i64;
            let lo = c[0].len() as i64 + 2;
            let limit = if m == 0 && rng.gen_bool(0.8) {
                n
            } else {
                rng.gen_range(lo..n)
            };
            vec![st(text), Py::Int(limit)]
        },
        eval: |c, m, a| {
            let text = a[0].text();
            let limit = a[1].int();
            let n = text.len() as i64;
            let fits = if m == Some(0) { n < limit } else { n <= limit };
            if fits {
                return Ok(st(text));
            }
            let suffix = &c[0];
            let mut cut = limit - suffix.len() as i64;
            if m == Some(1) {
                cut += 1;
            }
            let (x, y) = slice_bounds(text.len(), 0, cut);
            Ok(st(format!("{}{suffix}", &text[x..y])))
        },
    },
    Template {
        theme: 1,
        names: &["word_counts", "count_words", "word_frequencies"],
        source: r#"def __NAME__(text):
    """Count how often each (lower-cased) word occurs in `text`."""
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts
"#,
        consts: no_consts,
        mutations: &[Mutation {
            family: BugFamily::WrongConstant,
            find: "counts.get(word, 0)",
            replace: "counts.get(word, 1)",
            symptom: "",
        }],
        args: |rng, _, _| {
            let pool: Vec<&str> = WORDS.choose_multiple(rng, 3).copied().collect();
            vec![st(words_from(rng, &pool, 3, 6).join(" "))]
        },
        eval: |_, m, a| {
            let mut kv: Vec<(Py, Py)> = Vec::new();
            for w in a[0].text().to_lowercase().split_whitespace() {
                let key = st(w);
                match kv.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => *v = Py::Int(v.int() + 1),
                    None => kv.push((key, Py::Int(if m == Some(0) { 2 } else { 1 }))),
                }
            }
            Ok(Py::Dict(kv))
        },
    },
    Template {
        theme: 1,
        names: &["initials", "acronym", "first_letters"],
        source: r#"def __NAME__(phrase):
    """Return the upper-cased first letter of every word in `phrase`."""
    return "".join(word[0].upper() for word in phrase.split())
"#,
        consts: no_consts,
        mutations: &[Mutation {
            family: BugFamily::OffByOne,
            find: "word[0]",
            replace: "word[1]",
            symptom: "",
        }],
        args: |rng, _, _| {
            let mut w = words_from(rng, WORDS, 2, 4);
            if rng.gen_bool(0.25) {
                let at = rng.gen_range(0..=w.len());
                w.insert(at, "a".into());
            }
            vec![st(w.join(" "))]
        },
        eval: |_, m, a| {
            let idx = if m == Some(0) { 1 } else { 0 };
            let mut out = String::new();
            for w in a[0].text().split_whitespace() {
                match w.chars().nth(idx) {
                    Some(ch) => out.push(ch.to_ascii_uppercase()),
                    None => return Err("IndexError"),
                }
            }
            Ok(st(out))
        },
    },
    // ---- theme 2: time
    Template {
        theme: 2,
        names: &["format_clock", "as_clock", "to_hms"],
        source: r#"def __NAME__(seconds):
    """Format a number of seconds as HH:MM:SS."""
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}"
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongConstant,
                find: "divmod(minutes, 60)",
                replace: "divmod(minutes, 100)",
                symptom: "Durations under an hour look fine.",
            },
            Mutation {
                family: BugFamily::SwappedArguments,
                find: "divmod(seconds, 60)",
                replace: "divmod(60, seconds)",
                symptom: "",
            },
        ],
        args: |rng, _, m| {
            let s = if m == 0 {
                rng.gen_range(3600..=50_000)
            } else {
                rng.gen_range(61..=50_000)
            };
            vec![Py::Int(s)]
        },
        eval: |_, m, a| {
            let s = a[0].int();
            let (mut minutes, secs) = if m == Some(1) {
                (floordiv(60, s)?, pymod(60, s)?)
            } else {
                (floordiv(s, 60)?, pymod(s, 60)?)
            };
            let div = if m == Some(0) { 100 } else { 60 };
            let hours = floordiv(minutes, div)?;
            minutes = pymod(minutes, div)?;
            Ok(st(format!("{hours:02}:{minutes:02}:{secs:02}")))
        },
    },
    Template {
        theme: 2,
        names: &["is_leap_year", "leap_year", "is_leap"],
        source: r#"def __NAME__(year):
    """Return True if `year` is a leap year in the Gregorian calendar."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongOperator,
                find: "year % 4 == 0 and",
                replace: "year % 4 == 0 or",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongComparison,
                find: "year % 100 != 0",
                replace: "year % 100 == 0",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "year % 400 == 0",
                replace: "year % 40 == 0",
                symptom: "Only some century years seem to be affected.",
            },
        ],
        args: |rng, _, m| {
            let y = if m == 2 {
                rng.gen_range(10..=30) * 100
            } else {
                rng.gen_range(1600..=2400)
            };
            vec![Py::Int(y)]
        },
        eval: |_, m, a| {
            let y = a[0].int();
            let d4 = y % 4 == 0;
            let n100 = if m == Some(1) {
                y % 100 == 0
            } else {
                y % 100 != 0
            };
            let d400 = if m == Some(2) {
                y % 40 == 0
            } else {
                y % 400 == 0
            };
            let r = if m == Some(0) {
                d4 || (n100 || d400)
            } else {
                d4 && (n100 || d400)
            };
            Ok(Py::Bool(r))
        },
    },
    Template {
        theme: 2,
        names: &["minutes_between", "elapsed_minutes", "duration_minutes"],
        source: r#"def __NAME__(start, end):
    """Minutes from `start` to `end`, both "HH:MM" times on the same day."""
    start_hours, start_minutes = start.split(":")
    end_hours, end_minutes = end.split(":")
    begin = int(start_hours) * 60 + int(start_minutes)
    finish = int(end_hours) * 60 + int(end_minutes)
    return finish - begin
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongConstant,
                find: "int(end_hours) * 60",
                replace: "int(end_hours) * 100",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongOperator,
                find: "int(start_hours) * 60 + int(start_minutes)",
                replace: "int(start_hours) * 60 - int(start_minutes)",
                symptom: "",
            },
        ],
        args: |rng, _, _| {
            let a = rng.gen_range(0..23 * 60);
            let b = rng.gen_range(a + 1..24 * 60);
            let f = |t: i64| format!("{:02}:{:02}", t / 60, t % 60);
            vec![st(f(a)), st(f(b))]
        },
        eval: |_, m, a| {
            let parse = |s: &str| -> (i64, i64) {
                let (h, mm) = s.split_once(':').expect("HH:MM");
                (h.parse().unwrap(), mm.parse().unwrap())
            };
            let (sh, sm) = parse(a[0].text());
            let (eh, em) = parse(a[1].text());
            let begin = if m == Some(1) {
                sh * 60 - sm
            } else {
                sh * 60 + sm
            };
            let finish = eh * if m == Some(0) { 100 } else { 60 } + em;
            Ok(Py::Int(finish - begin))
        },
    },
    Template {
        theme: 2,
        names: &["weekday_name", "day_name", "name_of_day"],
        source: r#"def __NAME__(day_number):
    """Name of the weekday for `day_number` (1 = Monday, ..., 7 = Sunday, 8 = Monday...)."""
    names = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    return names[(day_number - 1) % 7]
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::OffByOne,
                find: "names[(day_number - 1) % 7]",
                replace: "names[day_number % 7]",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "(day_number - 1) % 7",
                replace: "(day_number - 1) % 6",
                symptom: "",
            },
        ],
        args: |rng, _, m| {
            let d = if m == 1 && rng.gen_bool(0.5) {
                7
            } else {
                rng.gen_range(1..=14)
            };
            vec![Py::Int(d)]
        },
        eval: |_, m, a| {
            const DAYS: [&str; 7] = [
                "Monday",
                "Tuesday",
                "Wednesday",
                "Thursday",
                "Friday",
                "Saturday",
                "Sunday",
            ];
            let d = a[0].int();
            let i = match m {
                Some(0) => pymod(d, 7)?,
                Some(1) => pymod(d - 1, 6)?,
                _ => pymod(d - 1, 7)?,
            };
            Ok(st(DAYS[i as usize]))
        },
    },
    // ---- theme 3: sequences
    Template {
        theme: 3,
        names: &["chunked", "chunks", "batched"],
        source: r#"def __NAME__(items, size):
    """Split `items` into consecutive lists of at most `size` items."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [items[i:i + size] for i in range(0, len(items), size)]
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::OffByOne,
                find: "range(0, len(items), size)",
                replace: "range(0, len(items) - 1, size)",
                symptom: "It looks like the last element can get lost.",
            },
            Mutation {
                family: BugFamily::OffByOne,
                find: "items[i:i + size]",
                replace: "items[i:i + size - 1]",
                symptom: "",
            },
        ],
        args: |rng, _, m| {
            let size = rng.gen_range(2..=4);
            let n = if m == 0 && rng.gen_bool(0.8) {
                size * rng.gen_range(1..=2) + 1
            } else {
                rng.gen_range(3..=9)
            };
            vec![li((0..n).map(|_| rng.gen_range(0..=20))), Py::Int(size)]
        },
        eval: |_, m, a| {
            let items = a[0].ints();
            let size = a[1].int() as usize;
            let stop = if m == Some(0) {
                items.len().saturating_sub(1)
            } else {
                items.len()
            };
            let width = if m == Some(1) { size - 1 } else { size };
            Ok(Py::List(
                (0..stop)
                    .step_by(size)
                    .map(|i| li(items[i..(i + width).min(items.len())].iter().copied()))
                    .collect(),
            ))
        },
    },
    Template {
        theme: 3,
        names: &["rotate_left", "rotated", "shift_left"],
        source: r#"def __NAME__(items, steps):
    """Rotate `items` left by `steps` positions, wrapping around."""
    if not items:
        return []
    steps = steps % len(items)
    return items[steps:] + items[:steps]
"#,
        consts: no_consts,
        mutations: &[Mutation {
            family: BugFamily::WrongOperator,
            find: "steps = steps % len(items)",
            replace: "steps = steps // len(items)",
            symptom: "",
        }],
        args: |rng, _, _| {
            let n = rng.gen_range(3..=6);
            let items: Vec<Py> = (0..n)
                .map(|i| st(((b'a' + i as u8) as char).to_string()))
                .collect();
            let steps = rng.gen_range(1..=2 * n as i64 + 1);
            vec![Py::List(items), Py::Int(steps)]
        },
        eval: |_, m, a| {
            let items = a[0].list();
            if items.is_empty() {
                return Ok(Py::List(vec![]));
            }
            let n = items.len() as i64;
            let steps = a[1].int();
            let s = if m == Some(0) {
                floordiv(steps, n)?
            } else {
                pymod(steps, n)?
            };
            let (x, _) = slice_bounds(items.len(), s, n);
            let (_, y) = slice_bounds(items.len(), 0, s);
            let mut out = items[x..].to_vec();
            out.extend_from_slice(&items[..y]);
            Ok(Py::List(out))
        },
    },
    Template {
        theme: 3,
        names: &["index_of", "find_index", "position_of"],
        source: r#"def __NAME__(items, target):
    """Index of the first occurrence of `target` in `items`, or -1 if it is absent."""
    for i in range(len(items)):
        if items[i] == target:
            return i
    return -1
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::OffByOne,
                find: "range(len(items))",
                replace: "range(1, len(items))",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "return -1",
                replace: "return 0",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongComparison,
                find: "if items[i] == target:",
                replace: "if items[i] != target:",
                symptom: "",
            },
        ],
        args: |rng, _, m| {
            let v = rand_ints(rng, 3, 7, 0, 30);
            let t = match m {
                0 => v[0],
                1 => 31 + rng.gen_range(0..10),
                _ => v[rng.gen_range(0..v.len())],
            };
            vec![li(v), Py::Int(t)]
        },
        eval: |_, m, a| {
            let v = a[0].ints();
            let t = a[1].int();
            let from = if m == Some(0) { 1 } else { 0 };
            for (i, &x) in v.iter().enumerate().skip(from) {
                if (m == Some(2)) != (x == t) {
                    return Ok(Py::Int(i as i64));
                }
            }
            Ok(Py::Int(if m == Some(1) { 0 } else { -1 }))
        },
    },
    Template {
        theme: 3,
        names: &["insert_sorted", "sorted_insert", "insert_in_order"],
        source: r#"def __NAME__(items, value):
    """Return a copy of the sorted list `items` with `value` inserted in order."""
    result = list(items)
    index = 0
    while index < len(result) and result[index] < value:
        index += 1
    result.insert(index, value)
    return result
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::SwappedArguments,
                find: "result.insert(index, value)",
                replace: "result.insert(value, index)",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongComparison,
                find: "result[index] < value",
                replace: "result[index] > value",
                symptom: "",
            },
        ],
        args: |rng, _, _| {
            let mut v = rand_ints(rng, 3, 6, 0, 30);
            v.sort();
            vec![li(v), Py::Int(rng.gen_range(0..=30))]
        },
        eval: |_, m, a| {
            let mut r = a[0].ints();
            let value = a[1].int();
            let mut index = 0usize;
            while index < r.len()
                && (if m == Some(1) {
                    r[index] > value
                } else {
                    r[index] < value
                })
            {
                index += 1;
            }
            let (pos, elem) = if m == Some(0) {
                (value, index as i64)
            } else {
                (index as i64, value)
            };
            // list.insert clamps the position like a slice index.
            let n = r.len() as i64;
            let p = if pos < 0 {
                (pos + n).max(0)
            } else {
                pos.min(n)
            };
            r.insert(p as usize, elem);
            Ok(li(r))
        },
    },
    Template {
        theme: 3,
        names: &["contains_sorted", "binary_contains", "in_sorted"],
        source: r#"def __NAME__(items, target):
    """Return True if `target` is in the sorted list `items` (binary search)."""
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return True
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return False
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongComparison,
                find: "while low <= high:",
                replace: "while low < high:",
                symptom: "",
            },
            Mutation {
                family: BugFamily::OffByOne,
                find: "high = mid - 1",
                replace: "high = mid - 2",
                symptom: "",
            },
        ],
        args: |rng, _, _| {
            let mut v: Vec<i64> = (0..40).collect();
            v.shuffle(rng);
            let mut v: Vec<i64> = v[..rng.gen_range(3..=8)].to_vec();
            v.sort();
            let t = if rng.gen_bool(0.8) {
                v[rng.gen_range(0..v.len())]
            } else {
                rng.gen_range(0..40)
            };
            vec![li(v), Py::Int(t)]
        },
        eval: |_, m, a| {
            let v = a[0].ints();
            let t = a[1].int();
            let (mut low, mut high) = (0i64, v.len() as i64 - 1);
            while if m == Some(0) {
                low < high
            } else {
                low <= high
            } {
                let mid = floordiv(low + high, 2)?;
                let x = v[mid as usize];
                if x == t {
                    return Ok(Py::Bool(true));
                }
                if x < t {
                    low = mid + 1;
                } else {
                    high = mid - if m == Some(1) { 2 } else { 1 };
                }
            }
            Ok(Py::Bool(false))
        },
    },
    // ---- theme 4: money
    Template {
        theme: 4,
        names: &["apply_discount", "discounted_price", "with_discount"],
        source: r#"def __NAME__(price, percent):
    """Price in cents after a `percent` discount (the discount is rounded down and capped at __C0__%)."""
    percent = min(percent, __C0__)
    return price - price * percent // 100
"#,
        consts: |rng| {
            let cap = [30, 40, 50, 60][rng.gen_range(0..4)];
            vec![cap.to_string(), (cap + 20).to_string()]
        },
        mutations: &[
            Mutation {
                family: BugFamily::WrongOperator,
                find: "return price - price * percent // 100",
                replace: "return price + price * percent // 100",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "min(percent, __C0__)",
                replace: "min(percent, __C1__)",
                symptom: "Discounts should never exceed __C0__%.",
            },
        ],
        args: |rng, c, m| {
            let cap = c_int(c, 0);
            let price = rng.gen_range(20..=999) * 5;
            let pct = if m == 1 {
                rng.gen_range(cap + 1..=cap + 20)
            } else {
                rng.gen_range(5..=cap)
            };
            vec![Py::Int(price), Py::Int(pct)]
        },
        eval: |c, m, a| {
            let cap = c_int(c, if m == Some(1) { 1 } else { 0 });
            let price = a[0].int();
            let pct = a[1].int().min(cap);
            let off = floordiv(price * pct, 100)?;
            Ok(Py::Int(if m == Some(0) {
                price + off
            } else {
                price - off
            }))
        },
    },
    Template {
        theme: 4,
        names: &["split_bill", "split_evenly", "fair_shares"],
        source: r#"def __NAME__(total, people):
    """Split `total` cents into `people` shares that differ by at most one cent."""
    share, rest = divmod(total, people)
    return [share + 1 if i < rest else share for i in range(people)]
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::SwappedArguments,
                find: "divmod(total, people)",
                replace: "divmod(people, total)",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongComparison,
                find: "if i < rest",
                replace: "if i <= rest",
                symptom: "The shares should add up to the total.",
            },
        ],
        args: |rng, _, _| {
            vec![
                Py::Int(rng.gen_range(10..=999)),
                Py::Int(rng.gen_range(2..=5)),
            ]
        },
        eval: |_, m, a| {
            let (total, people) = (a[0].int(), a[1].int());
            let (share, rest) = if m == Some(0) {
                (floordiv(people, total)?, pymod(people, total)?)
            } else {
                (floordiv(total, people)?, pymod(total, people)?)
            };
            Ok(li((0..people).map(|i| {
                let extra = if m == Some(1) { i <= rest } else { i < rest };
                if extra {
                    share + 1
                } else {
                    share
                }
            })))
        },
    },
    Template {
        theme: 4,
        names: &["compound", "grow_balance", "balance_after"],
        source: r#"def __NAME__(principal, rate, years):
    """Balance after `years` of yearly interest at `rate` percent (rounded down each year)."""
    balance = principal
    for _ in range(years):
        balance = balance + balance * rate // 100
    return balance
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::OffByOne,
                find: "range(years)",
                replace: "range(years - 1)",
                symptom: "It looks like one year of interest is missing.",
            },
            Mutation {
                family: BugFamily::WrongOperator,
                find: "balance * rate // 100",
                replace: "balance * rate % 100",
                symptom: "",
            },
        ],
        args: |rng, _, _| {
            vec![
                Py::Int(rng.gen_range(10..=200) * 50),
                Py::Int(rng.gen_range(1..=15)),
                Py::Int(rng.gen_range(1..=6)),
            ]
        },
        eval: |_, m, a| {
            let (mut b, rate, years) = (a[0].int(), a[1].int(), a[2].int());
            let n = if m == Some(0) { years - 1 } else { years };
            for _ in 0..n.max(0) {
                b += if m == Some(1) {
                    pymod(b * rate, 100)?
                } else {
                    floordiv(b * rate, 100)?
                };
            }
            Ok(Py::Int(b))
        },
    },
    Template {
        theme: 4,
        names: &["power_mod", "modpow", "mod_power"],
        source: r#"def __NAME__(base, exponent, modulus=__C0__):
    """Return `base` raised to `exponent`, modulo `modulus`."""
    return pow(base, exponent, modulus)
"#,
        consts: |rng| {
            let primes = [97, 101, 103, 1009, 7919];
            let i = rng.gen_range(0..primes.len());
            let j = (i + rng.gen_range(1..primes.len())) % primes.len();
            vec![primes[i].to_string(), primes[j].to_string()]
        },
        mutations: &[
            Mutation {
                family: BugFamily::SwappedArguments,
                find: "pow(base, exponent, modulus)",
                replace: "pow(exponent, base, modulus)",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongConstant,
                find: "modulus=__C0__",
                replace: "modulus=__C1__",
                symptom: "The default modulus should be __C0__.",
            },
        ],
        args: |rng, _, _| {
            let b = rng.gen_range(2..=30);
            let e = rng.gen_range(2..=30);
            vec![Py::Int(b), Py::Int(e)]
        },
        eval: |c, m, a| {
            let (mut b, mut e) = (a[0].int() as i128, a[1].int() as i128);
            let md = a
                .get(2)
                .map_or(c_int(c, if m == Some(1) { 1 } else { 0 }), Py::int)
                as i128;
            if m == Some(0) {
                std::mem::swap(&mut b, &mut e);
            }
            let mut r: i128 = 1 % md;
            let mut x = b.rem_euclid(md);
            while e > 0 {
                if e & 1 == 1 {
                    r = r * x % md;
                }
                x = x * x % md;
                e >>= 1;
            }
            Ok(Py::Int(r as i64))
        },
    },
    Template {
        theme: 4,
        names: &["digit_sum", "sum_of_digits", "digits_total"],
        source: r#"def __NAME__(number):
    """Sum of the decimal digits of a non-negative integer."""
    total = 0
    while number > 0:
        total += number % 10
        number //= 10
    return total
"#,
        consts: no_consts,
        mutations: &[
            Mutation {
                family: BugFamily::WrongConstant,
                find: "while number > 0:",
                replace: "while number > 9:",
                symptom: "",
            },
            Mutation {
                family: BugFamily::WrongOperator,
                find: "total += number % 10",
                replace: "total += number // 10",
                symptom: "",
            },
        ],
        args: |rng, _, _| vec![Py::Int(rng.gen_range(10..=99_999))],
        eval: |_, m, a| {
            let mut n = a[0].int();
            let mut total = 0;
            let stop = if m == Some(0) { 9 } else { 0 };
            while n > stop {
                total += if m == Some(1) { n / 10 } else { n % 10 };
                n /= 10;
            }
            Ok(Py::Int(total))
        },
    },
];
