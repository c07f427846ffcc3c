//! Toy SWE tasks: small Python packages with one planted bug, generated deterministically
//! from a seed, with a gold patch, a hidden test patch and SWE-bench style test lists.
//!
//! Each template in the bank (`bank`) is a Python function (source with placeholders), one or more
//! mutations (a single-line find/replace, tagged with its [`BugFamily`]), an argument
//! generator, and a Rust model of the function that gives both the correct and the
//! mutated result. The model lets the generator pick inputs that really expose the bug
//! (for the issue text and the FAIL_TO_PASS tests) and inputs that do not (for
//! PASS_TO_PASS tests of the buggy function), and state in the issue what the buggy code
//! returns. A test runs every generated task through pytest to check the model.

use std::collections::HashSet;
use std::fmt::Write as _;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};

use crate::tasks::{RepoFileRecord, TaskRecord};
use crate::toy::bank::{Template, BANK, PACKAGES, R, THEMES};
use crate::toy::python::{res_text, same, Py, Res};

mod bank;
mod python;

pub use bank::BugFamily;

/// The bug family of a toy task, from its instance id (`toy__<pkg>-<n>-<family>`).
pub fn family_of(instance_id: &str) -> Option<BugFamily> {
    let rest = instance_id.strip_prefix("toy__")?;
    let (_, fam) = rest.rsplit_once('-')?;
    BugFamily::parse(fam)
}

fn subst(text: &str, name: &str, consts: &[String]) -> String {
    let mut s = text.replace("__NAME__", name);
    for (i, c) in consts.iter().enumerate() {
        s = s.replace(&format!("__C{i}__"), c);
    }
    s
}

/// One instantiated function: template + name + constants.
struct Func {
    tpl: &'static Template,
    name: String,
    consts: Vec<String>,
}

impl Func {
    fn source(&self) -> String {
        subst(self.tpl.source, &self.name, &self.consts)
    }

    fn mutated_source(&self, m: usize) -> String {
        let mu = &self.tpl.mutations[m];
        let src = self.source();
        let find = subst(mu.find, &self.name, &self.consts);
        let replace = subst(mu.replace, &self.name, &self.consts);
        debug_assert_eq!(src.matches(&find).count(), 1, "mutation must match once");
        src.replacen(&find, &replace, 1)
    }

    fn call(&self, m: Option<usize>, args: &[Py]) -> Res {
        (self.tpl.eval)(&self.consts, m, args)
    }

    fn args(&self, rng: &mut R, m: usize) -> Vec<Py> {
        (self.tpl.args)(rng, &self.consts, m)
    }

    fn call_text(&self, module: &str, args: &[Py]) -> String {
        let a: Vec<String> = args.iter().map(Py::repr).collect();
        format!("{module}.{}({})", self.name, a.join(", "))
    }

    /// Up to `k` distinct argument lists on which the correct version does not raise and
    /// `keep(correct, buggy)` holds.
    fn find_args(
        &self,
        rng: &mut R,
        m: usize,
        buggy: Option<usize>,
        k: usize,
        avoid: &[Vec<Py>],
        keep: impl Fn(&Res, &Res) -> bool,
    ) -> Vec<Vec<Py>> {
        let nm = self.tpl.mutations.len();
        let mut out: Vec<Vec<Py>> = Vec::new();
        for attempt in 0..400 {
            // Cycle through every mutation's generator too, for variety.
            let gm = if attempt % 2 == 0 {
                m
            } else {
                attempt / 2 % nm
            };
            let args = self.args(rng, gm);
            if out.contains(&args) || avoid.contains(&args) {
                continue;
            }
            let good = self.call(None, &args);
            if good.is_err() {
                continue;
            }
            let bad = match buggy {
                Some(b) => self.call(Some(b), &args),
                None => good.clone(),
            };
            if keep(&good, &bad) {
                out.push(args);
                if out.len() == k {
                    break;
                }
            }
        }
        out
    }
}

/// A generated task plus the facts the generator knows about it (for tests and reports).
#[derive(Debug, Clone)]
pub struct ToyTask {
    pub record: TaskRecord,
    pub family: BugFamily,
    pub package: String,
    pub module: String,
    pub function: String,
    /// Python expression of the issue's example, e.g. `stats.window_sums([1, 2], 1)`
    /// (evaluate after `from <package> import <module>`).
    pub example_call: String,
    /// `repr()` of the expected result.
    pub expected: String,
    /// `repr()` of what the buggy code returns, or `raises <Exception>`.
    pub buggy: String,
}

fn mix(seed: u64, a: u64, b: u64) -> u64 {
    // splitmix64 over the combined words: independent streams per (task, attempt).
    let mut z =
        seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Generates `n` distinct toy tasks, deterministically from `seed`. The first `k` tasks
/// of `generate(n, s)` are the tasks of `generate(k, s)`.
pub fn generate(n: usize, seed: u64) -> Vec<TaskRecord> {
    generate_with(n, seed, ToyOptions::default())
}

/// Limits on the toy world, for a student that must learn it from scratch in minutes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToyOptions {
    /// Plant bugs in the first `templates` templates of [`template_order`] only (every
    /// template still appears as an intact neighbour): fewer kinds of bug, more examples
    /// of each in a short run.
    pub templates: Option<usize>,
    /// Name packages from the first `packages` names of the pool only, without the
    /// digit suffix some get otherwise: names a short run sees often enough to copy.
    pub packages: Option<usize>,
}

/// [`generate`] within the limits of `opts`.
pub fn generate_with(n: usize, seed: u64, opts: ToyOptions) -> Vec<TaskRecord> {
    generate_detailed_with(n, seed, opts)
        .into_iter()
        .map(|t| t.record)
        .collect()
}

/// The order in which `templates` limits the bank: round-robin over the themes, so any
/// prefix spans as many themes (kinds of module) as it can.
pub fn template_order() -> Vec<usize> {
    let mut by_theme: Vec<Vec<usize>> = vec![Vec::new(); THEMES.len()];
    for (t, tpl) in BANK.iter().enumerate() {
        by_theme[tpl.theme].push(t);
    }
    let deepest = by_theme.iter().map(Vec::len).max().unwrap_or(0);
    (0..deepest)
        .flat_map(|k| by_theme.iter().filter_map(move |v| v.get(k).copied()))
        .collect()
}

/// Number of templates in the bank (the largest useful `templates` limit).
pub fn template_count() -> usize {
    BANK.len()
}

/// Number of package names in the pool (the largest useful `packages` limit).
pub fn package_count() -> usize {
    PACKAGES.len()
}

/// [`generate`] with the generator's knowledge of each task.
pub fn generate_detailed(n: usize, seed: u64) -> Vec<ToyTask> {
    generate_detailed_with(n, seed, ToyOptions::default())
}

/// [`generate_with`] with the generator's knowledge of each task.
pub fn generate_detailed_with(n: usize, seed: u64, opts: ToyOptions) -> Vec<ToyTask> {
    let allowed: Vec<usize> = match opts.templates {
        Some(k) => template_order().into_iter().take(k.max(1)).collect(),
        None => (0..BANK.len()).collect(),
    };
    // Every (template, mutation) pair, shuffled by the seed, then cycled: families and
    // templates are spread evenly over any prefix.
    let mut combos: Vec<(usize, usize)> = BANK
        .iter()
        .enumerate()
        .filter(|(t, _)| allowed.contains(t))
        .flat_map(|(t, tpl)| (0..tpl.mutations.len()).map(move |m| (t, m)))
        .collect();
    combos.shuffle(&mut R::seed_from_u64(mix(seed, u64::MAX, 0)));
    let mut out: Vec<ToyTask> = Vec::with_capacity(n);
    let mut seen: HashSet<String> = HashSet::new();
    let mut i = 0u64;
    while out.len() < n {
        let (t, m) = combos[(i as usize) % combos.len()];
        for attempt in 0..20u64 {
            let mut rng = R::seed_from_u64(mix(seed, i, attempt));
            if let Some(task) = build_task(&mut rng, out.len(), t, m, opts.packages) {
                if seen.insert(task.record.problem_statement.clone()) {
                    out.push(task);
                    break;
                }
            }
        }
        i += 1;
    }
    out
}

fn pick_name(rng: &mut R, tpl: &Template) -> String {
    tpl.names[rng.gen_range(0..tpl.names.len())].to_string()
}

fn diff(path: &str, old: &str, new: &str) -> String {
    let body = similar::TextDiff::from_lines(old, new)
        .unified_diff()
        .context_radius(3)
        .header(&format!("a/{path}"), &format!("b/{path}"))
        .to_string();
    format!("diff --git a/{path} b/{path}\n{body}")
}

fn module_text(doc: &str, funcs: &[String]) -> String {
    let mut s = format!("\"\"\"{doc}\"\"\"\n");
    for f in funcs {
        s.push_str("\n\n");
        s.push_str(f);
    }
    s
}

fn test_fn(name: &str, asserts: &[String]) -> String {
    let mut s = format!("def {name}():\n");
    for a in asserts {
        let _ = writeln!(s, "    {a}");
    }
    s
}

fn assert_line(f: &Func, module: &str, args: &[Py]) -> String {
    let want = f.call(None, args).expect("correct version does not raise");
    format!("assert {} == {}", f.call_text(module, args), want.repr())
}

fn build_task(
    rng: &mut R,
    index: usize,
    t: usize,
    m: usize,
    packages: Option<usize>,
) -> Option<ToyTask> {
    let tpl = &BANK[t];
    let mutation = &tpl.mutations[m];
    let pool = packages.map_or(PACKAGES.len(), |k| k.clamp(1, PACKAGES.len()));
    let name = PACKAGES[rng.gen_range(0..pool)];
    let suffix = rng.gen_bool(0.3);
    let package = if suffix && packages.is_none() {
        format!("{name}{}", rng.gen_range(2..10))
    } else {
        name.to_string()
    };

    // Modules: the buggy theme plus two or three others.
    let mut themes: Vec<usize> = (0..THEMES.len()).filter(|&x| x != tpl.theme).collect();
    themes.shuffle(rng);
    themes.truncate(rng.gen_range(2..=3));
    themes.insert(rng.gen_range(0..=themes.len()), tpl.theme);

    struct Module {
        name: String,
        doc: &'static str,
        funcs: Vec<Func>,
        buggy: Option<usize>,
    }
    let mut modules: Vec<Module> = Vec::new();
    for &th in &themes {
        let (doc, names) = THEMES[th];
        let mut members: Vec<usize> = (0..BANK.len())
            .filter(|&k| BANK[k].theme == th && k != t)
            .collect();
        members.shuffle(rng);
        let mut funcs: Vec<Func> = Vec::new();
        let mut buggy = None;
        let count = if th == tpl.theme {
            rng.gen_range(1..=2)
        } else {
            rng.gen_range(2..=3)
        };
        for &k in members.iter().take(count) {
            let tp = &BANK[k];
            funcs.push(Func {
                tpl: tp,
                name: pick_name(rng, tp),
                consts: (tp.consts)(rng),
            });
        }
        if th == tpl.theme {
            let at = rng.gen_range(0..=funcs.len());
            funcs.insert(
                at,
                Func {
                    tpl,
                    name: pick_name(rng, tpl),
                    consts: (tpl.consts)(rng),
                },
            );
            buggy = Some(at);
        }
        modules.push(Module {
            name: names[rng.gen_range(0..names.len())].to_string(),
            doc,
            funcs,
            buggy,
        });
    }

    let bm = modules.iter().position(|md| md.buggy.is_some())?;
    let bf = modules[bm].buggy?;
    let module = modules[bm].name.clone();
    let func = &modules[bm].funcs[bf];

    // The issue's example and the FAIL_TO_PASS cases: inputs where the bug shows.
    let differs = |a: &Res, b: &Res| !same(a, b);
    let exposing = func.find_args(rng, m, Some(m), 3, &[], differs);
    let example = exposing.first()?.clone();
    let expected = func.call(None, &example).ok()?;
    let buggy_res = func.call(Some(m), &example);
    let more: Vec<Vec<Py>> = exposing[1..].to_vec();
    // PASS_TO_PASS for the buggy function itself: inputs the bug does not affect.
    let unaffected = func.find_args(rng, m, Some(m), 2, &exposing, same);

    let mut files: Vec<RepoFileRecord> = Vec::new();
    let mut gold_module = String::new();
    let mut buggy_module = String::new();
    let mut tests_before = String::new();
    let mut pass_to_pass: Vec<String> = Vec::new();
    let test_path = format!("tests/test_{module}.py");
    for (mi, md) in modules.iter().enumerate() {
        let sources: Vec<String> = md.funcs.iter().map(Func::source).collect();
        let text = module_text(md.doc, &sources);
        let mut test = format!("from {package} import {}\n", md.name);
        let mut test_names = Vec::new();
        for (fi, f) in md.funcs.iter().enumerate() {
            let cases = if md.buggy == Some(fi) {
                unaffected.clone()
            } else {
                f.find_args(rng, 0, None, 2, &[], |_, _| true)
            };
            if cases.is_empty() {
                continue;
            }
            let name = format!("test_{}", f.name);
            let asserts: Vec<String> = cases.iter().map(|a| assert_line(f, &md.name, a)).collect();
            test.push_str("\n\n");
            test.push_str(&test_fn(&name, &asserts));
            test_names.push(name);
        }
        let path = format!("tests/test_{}.py", md.name);
        if mi == bm {
            gold_module = text.clone();
            let mut bsrc = sources.clone();
            bsrc[bf] = md.funcs[bf].mutated_source(m);
            buggy_module = module_text(md.doc, &bsrc);
            tests_before = test.clone();
            pass_to_pass = test_names.iter().map(|n| format!("{path}::{n}")).collect();
            files.push(RepoFileRecord {
                path: format!("{package}/{}.py", md.name),
                content: buggy_module.clone(),
            });
        } else {
            files.push(RepoFileRecord {
                path: format!("{package}/{}.py", md.name),
                content: text,
            });
        }
        files.push(RepoFileRecord {
            path,
            content: test,
        });
    }
    let mod_names: Vec<&str> = modules.iter().map(|md| md.name.as_str()).collect();
    files.insert(
        0,
        RepoFileRecord {
            path: format!("{package}/__init__.py"),
            content: format!(
                "\"\"\"{package}: small utility helpers.\"\"\"\n\n__all__ = [{}]\n",
                mod_names
                    .iter()
                    .map(|n| format!("\"{n}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    );
    files.insert(
        0,
        RepoFileRecord {
            path: "README.md".into(),
            content: format!(
                "# {package}\n\nSmall utility helpers, one module per topic: {}.\n\nRun the tests with `python -m pytest`.\n",
                mod_names
                    .iter()
                    .map(|n| format!("`{package}.{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    );
    files.insert(
        1,
        RepoFileRecord {
            path: "pytest.ini".into(),
            content: "[pytest]\ntestpaths = tests\npythonpath = .\n".into(),
        },
    );

    // The hidden tests: the issue's example plus further exposing cases.
    let fname = &func.name;
    let mut tests_after = tests_before.clone();
    let mut f2p = Vec::new();
    let issue_name = format!("test_{fname}_issue");
    tests_after.push_str("\n\n");
    tests_after.push_str(&test_fn(
        &issue_name,
        &[assert_line(func, &module, &example)],
    ));
    f2p.push(format!("{test_path}::{issue_name}"));
    if !more.is_empty() {
        let name = format!("test_{fname}_regression");
        let asserts: Vec<String> = more.iter().map(|a| assert_line(func, &module, a)).collect();
        tests_after.push_str("\n\n");
        tests_after.push_str(&test_fn(&name, &asserts));
        f2p.push(format!("{test_path}::{name}"));
    }

    let module_path = format!("{package}/{module}.py");
    let patch = diff(&module_path, &buggy_module, &gold_module);
    let test_patch = diff(&test_path, &tests_before, &tests_after);

    let args_text: Vec<String> = example.iter().map(Py::repr).collect();
    let call = format!("{fname}({})", args_text.join(", "));
    let symptom = subst(mutation.symptom, fname, &func.consts);
    let got = res_text(&buggy_res);
    let want = expected.repr();
    // Every title starts by naming the file to fix (the student's first job is to find
    // it there), spelled as a command would spell it (the same tokens).
    let title = match rng.gen_range(0..3) {
        0 => format!("In {module_path}, `{fname}` returns the wrong result"),
        1 => format!("In {module_path}: wrong output from `{fname}`"),
        _ => format!("In {module_path}: a bug in `{fname}`"),
    };
    let body = match rng.gen_range(0..3) {
        0 => format!("Calling `{call}` {got}, but it should return `{want}`."),
        1 => format!("`{module}.{call}` should return `{want}`, but it {}.", got),
        _ => format!("I expected `{call}` to return `{want}`. Instead it {got}."),
    };
    let mut statement = format!("{title}\n\n{body}");
    if !symptom.is_empty() {
        statement.push(' ');
        statement.push_str(&symptom);
    }
    let _ = write!(
        statement,
        "\n\nTo reproduce:\n\n```python\nfrom {package} import {module}\n\nprint({module}.{call})  # expected {want}\n```\n\nThe code is in {module_path}.\n"
    );

    let family = mutation.family;
    let record = TaskRecord {
        instance_id: format!("toy__{package}-{index}-{}", family.as_str()),
        repo: format!("toy/{package}"),
        base_commit: String::new(),
        problem_statement: statement,
        hints_text: String::new(),
        patch,
        test_patch,
        fail_to_pass: f2p,
        pass_to_pass,
        version: "1.0".into(),
        files,
        image: String::new(),
        test_cmd: String::new(),
        log_parser: String::new(),
    };
    Some(ToyTask {
        record,
        family,
        package: package.clone(),
        module: module.clone(),
        function: fname.clone(),
        example_call: func.call_text(&module, &example),
        expected: want,
        buggy: match &buggy_res {
            Ok(v) => v.repr(),
            Err(e) => format!("raises {e}"),
        },
    })
}

/// Splits tasks into (train, held-out), deterministically and independently of input
/// order. Tasks with the same problem statement (whitespace-normalised) or the same
/// instance id always land on the same side, so no problem is shared. Roughly
/// `heldout_fraction` of the tasks are held out (chosen by a hash of the problem).
pub fn split(tasks: Vec<TaskRecord>, heldout_fraction: f64) -> (Vec<TaskRecord>, Vec<TaskRecord>) {
    let n = tasks.len();
    let frac = if heldout_fraction.is_nan() {
        0.0
    } else {
        heldout_fraction.clamp(0.0, 1.0)
    };
    // Union-find over tasks sharing a statement or an id.
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut by_key: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (i, t) in tasks.iter().enumerate() {
        for key in [
            format!("s:{}", norm(&t.problem_statement)),
            format!("i:{}", t.instance_id),
        ] {
            match by_key.get(&key) {
                Some(&j) => {
                    let (a, b) = (find(&mut parent, i), find(&mut parent, j));
                    parent[a] = b;
                }
                None => {
                    by_key.insert(key, i);
                }
            }
        }
    }
    // Order groups by a hash of their smallest statement: stable and order-independent.
    let mut groups: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for i in 0..n {
        let r = find(&mut parent, i);
        groups.entry(r).or_default().push(i);
    }
    let mut keyed: Vec<(String, Vec<usize>)> = groups
        .into_values()
        .map(|members| {
            let key = members
                .iter()
                .map(|&i| norm(&tasks[i].problem_statement))
                .min()
                .unwrap_or_default();
            (hex::encode(Sha256::digest(key.as_bytes())), members)
        })
        .collect();
    keyed.sort();
    let target = (frac * n as f64).round() as usize;
    let mut held = vec![false; n];
    let mut count = 0;
    for (_, members) in &keyed {
        if count >= target {
            break;
        }
        count += members.len();
        for &i in members {
            held[i] = true;
        }
    }
    let mut train = Vec::new();
    let mut heldout = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        if held[i] {
            heldout.push(t);
        } else {
            train.push(t);
        }
    }
    (train, heldout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mutation_matches_its_source_exactly_once() {
        let mut rng = R::seed_from_u64(0);
        for tpl in BANK {
            for name in tpl.names {
                let f = Func {
                    tpl,
                    name: name.to_string(),
                    consts: (tpl.consts)(&mut rng),
                };
                for (m, mu) in tpl.mutations.iter().enumerate() {
                    let find = subst(mu.find, name, &f.consts);
                    assert_eq!(f.source().matches(&find).count(), 1, "{name} m{m}");
                    assert_ne!(f.mutated_source(m), f.source());
                    assert_eq!(
                        f.mutated_source(m).lines().count(),
                        f.source().lines().count(),
                        "mutations change one line"
                    );
                }
            }
        }
    }

    #[test]
    fn bank_covers_all_families_and_themes_have_enough_functions() {
        assert!(BANK.len() >= 12);
        for fam in BugFamily::ALL {
            assert!(
                BANK.iter()
                    .flat_map(|t| t.mutations)
                    .filter(|m| m.family == fam)
                    .count()
                    >= 3,
                "{fam:?}"
            );
        }
        for th in 0..THEMES.len() {
            assert!(BANK.iter().filter(|t| t.theme == th).count() >= 4);
        }
    }

    #[test]
    fn generation_is_deterministic_distinct_and_prefix_stable() {
        let a = generate(40, 7);
        let b = generate(40, 7);
        assert_eq!(a, b);
        assert_eq!(generate(10, 7), a[..10].to_vec());
        assert_ne!(generate(10, 8), a[..10].to_vec());
        let ids: HashSet<_> = a.iter().map(|t| t.instance_id.clone()).collect();
        assert_eq!(ids.len(), 40);
        let stmts: HashSet<_> = a.iter().map(|t| t.problem_statement.clone()).collect();
        assert_eq!(stmts.len(), 40);
        let fams: HashSet<_> = a.iter().filter_map(|t| family_of(&t.instance_id)).collect();
        assert_eq!(fams.len(), 5);
    }

    #[test]
    fn tasks_are_well_formed() {
        for seed in 0..5 {
            for t in generate_detailed(60, seed) {
                let r = &t.record;
                assert_eq!(family_of(&r.instance_id), Some(t.family));
                let modules = r
                    .files
                    .iter()
                    .filter(|f| f.path.starts_with(&t.package) && !f.path.ends_with("__init__.py"))
                    .count();
                assert!((3..=4).contains(&modules), "{} modules", modules);
                assert_eq!(
                    r.gold_files(),
                    vec![format!("{}/{}.py", t.package, t.module)]
                );
                let test_file = format!("tests/test_{}.py", t.module);
                assert_eq!(r.test_files(), vec![test_file.clone()]);
                assert!(r.files.iter().any(|f| f.path == test_file));
                assert!(!r.fail_to_pass.is_empty());
                for id in r.fail_to_pass.iter().chain(&r.pass_to_pass) {
                    assert!(id.starts_with(&format!("{test_file}::test_")), "{id}");
                }
                assert!(r.problem_statement.contains(&t.function));
                // ...and ends with it, next to where the student's reply starts.
                let tail = format!("The code is in {}/{}.py.\n", t.package, t.module);
                assert!(
                    r.problem_statement.ends_with(&tail),
                    "{}",
                    r.problem_statement
                );
                let path = format!("In {}/{}.py", t.package, t.module);
                assert!(
                    r.problem_statement.starts_with(&path),
                    "{}",
                    r.problem_statement
                );
                assert!(r.problem_statement.contains(&t.expected));
                assert_ne!(t.expected, t.buggy);
                // The gold patch applies to the buggy file (checked in Rust here; the
                // pytest test checks `git apply`).
                let fp = &crate::tasks::parse_unified_diff(&r.patch).unwrap()[0];
                let old = &r
                    .files
                    .iter()
                    .find(|f| Some(f.path.as_str()) == fp.path())
                    .unwrap()
                    .content;
                let new = crate::tasks::apply_file_patch(old, fp).unwrap();
                assert_ne!(&new, old);
            }
        }
    }

    #[test]
    fn a_template_limit_plants_only_those_bugs_and_spans_the_themes() {
        let order = template_order();
        assert_eq!(order.len(), BANK.len());
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..BANK.len()).collect::<Vec<_>>());
        let first: HashSet<usize> = order[..THEMES.len()]
            .iter()
            .map(|&t| BANK[t].theme)
            .collect();
        assert_eq!(first.len(), THEMES.len(), "a prefix spans the themes");
        let opts = ToyOptions {
            templates: Some(6),
            packages: Some(5),
        };
        let tasks = generate_detailed_with(60, 1, opts);
        let allowed: Vec<&str> = order[..6]
            .iter()
            .flat_map(|&t| BANK[t].names.iter().copied())
            .collect();
        for t in &tasks {
            assert!(allowed.contains(&t.function.as_str()), "{}", t.function);
        }
        let stmts: HashSet<_> = tasks.iter().map(|t| &t.record.problem_statement).collect();
        assert_eq!(stmts.len(), 60, "still distinct tasks");
        for t in &tasks {
            assert!(PACKAGES[..5].contains(&t.package.as_str()), "{}", t.package);
        }
        assert_eq!(generate_with(10, 1, ToyOptions::default()), generate(10, 1));
    }

    #[test]
    fn split_is_deterministic_disjoint_and_order_independent() {
        let tasks = generate(50, 3);
        let (train, held) = split(tasks.clone(), 0.2);
        assert_eq!(train.len() + held.len(), 50);
        assert!((8..=12).contains(&held.len()), "{}", held.len());
        let mut rev = tasks.clone();
        rev.reverse();
        let (_, held2) = split(rev, 0.2);
        let ids = |v: &[TaskRecord]| {
            v.iter()
                .map(|t| t.instance_id.clone())
                .collect::<HashSet<_>>()
        };
        assert_eq!(ids(&held), ids(&held2));
        assert!(ids(&train).is_disjoint(&ids(&held)));
        // Identical problems stay together.
        let mut dup = tasks[0].clone();
        dup.instance_id = "toy__copy-0-off_by_one".into();
        let mut with_dup = tasks.clone();
        with_dup.push(dup);
        for frac in [0.1, 0.3, 0.5, 0.9] {
            let (tr, he) = split(with_dup.clone(), frac);
            let a = tr
                .iter()
                .any(|t| t.problem_statement == tasks[0].problem_statement);
            let b = he
                .iter()
                .any(|t| t.problem_statement == tasks[0].problem_statement);
            assert!(a != b);
        }
        let (tr, he) = split(tasks.clone(), 0.0);
        assert_eq!((tr.len(), he.len()), (50, 0));
        let (tr, he) = split(tasks, 1.0);
        assert_eq!((tr.len(), he.len()), (0, 50));
    }
}
