//! `tutor eval`: the gold-patch oracle resolves every toy task and an agent that submits
//! nothing resolves none, in the local sandbox and in Docker containers (the Docker half
//! skips, saying so, only when no engine answers). No container is left behind.

mod common;

use std::process::Command;

use common::tutor;

fn results(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn eval(dir: &std::path::Path, sandbox: &str, agent: &str) -> Vec<serde_json::Value> {
    let tasks = dir.join("tasks.jsonl");
    let out = dir.join(format!("{sandbox}-{agent}.jsonl"));
    let o = tutor(&[
        "eval",
        "--tasks",
        tasks.to_str().unwrap(),
        "--agent",
        agent,
        "--sandbox",
        sandbox,
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{stdout}");
    // Warnings (a container removal the engine refused, say) show with the test's output.
    for line in String::from_utf8_lossy(&o.stderr).lines() {
        if line.contains("WARN") || line.contains("ERROR") {
            println!("tutor eval: {line}");
        }
    }
    results(&out)
}

fn toy_tasks(dir: &std::path::Path, n: usize) {
    let tasks = dir.join("tasks.jsonl");
    let o = tutor(&[
        "tasks",
        "toy",
        "--n",
        &n.to_string(),
        "--seed",
        "21",
        "--out",
        tasks.to_str().unwrap(),
    ]);
    assert!(o.status.success());
}

fn check(oracle: &[serde_json::Value], noop: &[serde_json::Value], n: usize, sandbox: &str) {
    assert_eq!(oracle.len(), n);
    for r in oracle {
        assert_eq!(r["status"], "RESOLVED", "{r}");
        assert_eq!(r["sandbox"], sandbox);
        assert!(r["patch"].as_str().unwrap().contains("diff --git"), "{r}");
    }
    assert_eq!(noop.len(), n);
    for r in noop {
        assert_eq!(r["status"], "UNRESOLVED", "{r}");
        assert_eq!(r["patch"], "");
    }
}

#[test]
fn eval_local_oracle_resolves_all_noop_none() {
    let dir = tempfile::tempdir().unwrap();
    toy_tasks(dir.path(), 6);
    let oracle = eval(dir.path(), "local", "oracle");
    let noop = eval(dir.path(), "local", "noop");
    check(&oracle, &noop, 6, "local");
}

/// The containers `tutor eval` labelled, one line each: id, state, run label.
fn eval_containers() -> Vec<String> {
    let o = Command::new("docker")
        .args([
            "ps",
            "-a",
            "--filter",
            "label=tutor.worker=eval",
            "--format",
            "{{.ID}} {{.Status}} {{.Label \"tutor.run\"}}",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Whether a Docker engine answers (saying SKIPPED when none does).
fn docker_answers() -> bool {
    let ok = Command::new("docker")
        .arg("info")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIPPED: no Docker engine reachable (`docker info` failed)");
    }
    ok
}

#[test]
fn eval_docker_oracle_resolves_all_noop_none_and_leaves_no_container() {
    if !docker_answers() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    toy_tasks(dir.path(), 8);
    let oracle = eval(dir.path(), "docker", "oracle");
    let noop = eval(dir.path(), "docker", "noop");
    check(&oracle, &noop, 8, "docker");
    let left = eval_containers();
    assert!(
        left.is_empty(),
        "containers left behind:\n{}",
        left.join("\n")
    );
}

/// Runs `git` in `dir` with a fixed identity and dates (so the base commit's hash is the
/// same wherever the test runs), returning its stdout.
fn git(dir: &std::path::Path, args: &[&str]) -> String {
    let o = Command::new("git")
        .current_dir(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@t")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@t")
        .env("GIT_AUTHOR_DATE", "2020-01-01T00:00:00Z")
        .env("GIT_COMMITTER_DATE", "2020-01-01T00:00:00Z")
        .output()
        .unwrap();
    assert!(o.status.success(), "git {args:?}: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// A Django-shaped repository: a bug in `django/utils/text.py`, unittest tests under
/// `tests/`, and `tests/runtests.py`, a stand-in for Django's runner (unittest at
/// `--verbosity 2` prints `test_x (module.Class.test_x) ... ok`, the format Django's
/// runner inherits) that runs only under `#!/usr/bin/env python`, which the image has
/// only inside its activated environment. Returns the base commit, the gold patch and
/// the test patch.
fn django_like_repo(repo: &std::path::Path) -> (String, String, String) {
    let files = [
        ("django/__init__.py", "VERSION = (3, 0)\n"),
        ("django/utils/__init__.py", ""),
        (
            "django/utils/text.py",
            "def capfirst(x):\n    return x and str(x)[0].upper() + str(x)[1:]\n\n\n\
             def slugify(value):\n    return value.strip().lower().replace(\" \", \"-\")\n",
        ),
        (
            "tests/runtests.py",
            "#!/usr/bin/env python\n\
             import argparse, os, sys, unittest\n\
             p = argparse.ArgumentParser()\n\
             p.add_argument('labels', nargs='*')\n\
             p.add_argument('--verbosity', type=int, default=1)\n\
             p.add_argument('--settings')\n\
             p.add_argument('--parallel')\n\
             a = p.parse_args()\n\
             here = os.path.dirname(os.path.abspath(__file__))\n\
             sys.path[:0] = [here, os.path.dirname(here)]\n\
             print(\"Testing against Django installed in '%s/django'\" % os.path.dirname(here))\n\
             suite = unittest.defaultTestLoader.loadTestsFromNames(a.labels)\n\
             r = unittest.TextTestRunner(verbosity=a.verbosity, stream=sys.stdout).run(suite)\n\
             sys.exit(not r.wasSuccessful())\n",
        ),
        ("tests/utils_tests/__init__.py", ""),
        (
            "tests/utils_tests/test_text.py",
            "import unittest\n\nfrom django.utils import text\n\n\n\
             class TextTests(unittest.TestCase):\n    def test_capfirst(self):\n        \
             self.assertEqual(text.capfirst('hello'), 'Hello')\n",
        ),
    ];
    for (path, content) in files {
        let p = repo.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        repo.join("tests/runtests.py"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    git(repo, &["init", "-q"]);
    git(repo, &["add", "-A"]);
    git(repo, &["commit", "-q", "-m", "base"]);
    let base = git(repo, &["rev-parse", "HEAD"]).trim().to_string();
    let text = repo.join("django/utils/text.py");
    let buggy = std::fs::read_to_string(&text).unwrap();
    std::fs::write(
        &text,
        buggy.replace(
            "value.strip().lower().replace(\" \", \"-\")",
            "\"-\".join(value.strip().lower().split())",
        ),
    )
    .unwrap();
    let gold = git(repo, &["diff"]);
    git(repo, &["checkout", "-q", "--", "."]);
    let tests = repo.join("tests/utils_tests/test_text.py");
    let mut t = std::fs::read_to_string(&tests).unwrap();
    t.push_str(
        "\n    def test_slugify_spaces(self):\n        \
         self.assertEqual(text.slugify(' A  b '), 'a-b')\n",
    );
    std::fs::write(&tests, t).unwrap();
    let test_patch = git(repo, &["diff"]);
    git(repo, &["checkout", "-q", "--", "."]);
    (base, gold, test_patch)
}

/// Builds the SWE-bench-style image from tests/fixtures/swebench-mimic with `repo` as its
/// /testbed and the conda-style env named `env_name`.
fn build_mimic_image(ctx: &std::path::Path, tag: &str, env_name: &str) {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/swebench-mimic");
    for f in ["Dockerfile", "activate"] {
        std::fs::copy(fixture.join(f), ctx.join(f)).unwrap();
    }
    let o = Command::new("docker")
        .args(["build", "-q", "-t", tag, "--build-arg"])
        .arg(format!("ENV_NAME={env_name}"))
        .arg(ctx)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "docker build of {tag} failed (the base is tutor/base:bookworm, from `make images`): {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Issue 15's image test: an image laid out like a SWE-bench instance image (root-owned
/// /testbed, an environment that must be activated, Django's runner, no pytest anywhere
/// in the grading) is graded by the harness's Django spec: the oracle resolves the task
/// (RESOLVED_FULL), an agent that submits nothing does not (RESOLVED_NO, its
/// PASS_TO_PASS test still passing); a version the harness does not know is NO_TEST_SPEC
/// and an image without the environment ENVIRONMENT_ERROR, each naming the task.
#[test]
fn eval_a_swebench_style_image_is_graded_by_the_harness_spec() {
    if !docker_answers() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ctx = dir.path().join("ctx");
    let repo = ctx.join("testbed");
    std::fs::create_dir_all(&repo).unwrap();
    let (base, gold, test_patch) = django_like_repo(&repo);
    build_mimic_image(&ctx, "tutor/test-swebench-mimic:latest", "testbed");
    build_mimic_image(&ctx, "tutor/test-swebench-mimic:noenv", "other");

    let f2p = "test_slugify_spaces (utils_tests.test_text.TextTests.test_slugify_spaces)";
    let p2p = "test_capfirst (utils_tests.test_text.TextTests.test_capfirst)";
    let task = |id: &str, version: &str, image: &str| {
        serde_json::json!({
            "instance_id": id, "repo": "django/django", "version": version,
            "base_commit": base, "problem_statement": "slugify keeps runs of spaces",
            "patch": gold, "test_patch": test_patch,
            "FAIL_TO_PASS": [f2p], "PASS_TO_PASS": [p2p], "image": image,
        })
        .to_string()
    };
    let lines = [
        task(
            "django__django-1",
            "3.0",
            "tutor/test-swebench-mimic:latest",
        ),
        task(
            "django__django-2",
            "0.1",
            "tutor/test-swebench-mimic:latest",
        ),
        task("django__django-3", "3.0", "tutor/test-swebench-mimic:noenv"),
    ];
    std::fs::write(dir.path().join("tasks.jsonl"), lines.join("\n") + "\n").unwrap();

    let by_id =
        |rs: Vec<serde_json::Value>| -> std::collections::BTreeMap<String, serde_json::Value> {
            rs.into_iter()
                .map(|r| (r["instance_id"].as_str().unwrap().to_string(), r))
                .collect()
        };
    let oracle = by_id(eval(dir.path(), "docker", "oracle"));
    let noop = by_id(eval(dir.path(), "docker", "noop"));

    let r = &oracle["django__django-1"];
    assert_eq!(r["status"], "RESOLVED", "{r}");
    assert_eq!(r["resolution"], "RESOLVED_FULL", "{r}");
    let grading = r["grading"].as_str().unwrap();
    assert!(
        grading.contains("./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1")
            && grading.contains("django log parser"),
        "{grading}"
    );
    let r = &noop["django__django-1"];
    assert_eq!(r["status"], "UNRESOLVED", "{r}");
    assert_eq!(r["resolution"], "RESOLVED_NO", "{r}");

    for results in [&oracle, &noop] {
        let r = &results["django__django-2"];
        assert_eq!(r["status"], "NO_TEST_SPEC", "{r}");
        let e = r["error"].as_str().unwrap();
        assert!(
            e.contains("django__django-2") && e.contains("\"0.1\""),
            "{e}"
        );
        let r = &results["django__django-3"];
        assert_eq!(r["status"], "ENVIRONMENT_ERROR", "{r}");
        let e = r["error"].as_str().unwrap();
        assert!(
            e.contains("django__django-3") && e.contains("tutor/test-swebench-mimic:noenv"),
            "{e}"
        );
    }
    assert!(eval_containers().is_empty(), "containers left behind");
}
