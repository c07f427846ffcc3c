use super::*;

fn task(repo: &str, version: &str) -> TaskRecord {
    TaskRecord {
        instance_id: format!("{}-1", repo.replace('/', "__")),
        repo: repo.into(),
        version: version.into(),
        test_patch: "\
diff --git a/tests/admin_views/tests.py b/tests/admin_views/tests.py
--- a/tests/admin_views/tests.py
+++ b/tests/admin_views/tests.py
@@ -1 +1 @@
-x
+y
diff --git a/tests/admin_views/fixtures/data.json b/tests/admin_views/fixtures/data.json
new file mode 100644
diff --git a/tests/i18n/sampleproject/templates/base.py b/tests/i18n/sampleproject/templates/base.py
"
        .into(),
        ..Default::default()
    }
}

#[test]
fn django_gets_the_runner_dotted_modules_and_its_locale() {
    let spec = spec_for(&task("django/django", "3.0")).unwrap();
    assert_eq!(spec.source, SpecSource::Harness);
    assert_eq!(spec.parser, Some(LogParser::Django));
    assert_eq!(
        spec.test_command(),
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 \
         admin_views.tests i18n.sampleproject.templates.base"
    );
    assert_eq!(spec.activate.as_deref(), Some(CONDA_ACTIVATE));
    assert!(spec
        .eval_commands
        .iter()
        .any(|c| c == "export LANG=en_US.UTF-8"));
    assert_eq!(spec.install.as_deref(), Some("python -m pip install -e ."));
    // 1.9 runs without --parallel, as in the harness.
    let spec = spec_for(&task("django/django", "1.9")).unwrap();
    assert_eq!(spec.test_cmd, "./tests/runtests.py --verbosity 2");
    assert_eq!(spec.install.as_deref(), Some("python setup.py install"));
}

#[test]
fn each_repository_gets_its_command_and_parser() {
    let cases = [
        (
            "sympy/sympy",
            "1.12",
            LogParser::Sympy,
            "bin/test -C --verbose",
        ),
        (
            "astropy/astropy",
            "1.3",
            LogParser::PytestV2,
            "console_output_style=classic",
        ),
        ("astropy/astropy", "5.1", LogParser::PytestV2, "pytest -rA"),
        ("astropy/astropy", "v5.3", LogParser::PytestV2, "pytest -rA"),
        (
            "sphinx-doc/sphinx",
            "7.2",
            LogParser::PytestV2,
            "tox --current-env -epy39 -v --",
        ),
        (
            "mwaskom/seaborn",
            "0.12",
            LogParser::Seaborn,
            "pytest --no-header -rA",
        ),
        (
            "matplotlib/matplotlib",
            "3.7",
            LogParser::Matplotlib,
            "pytest -rA",
        ),
        (
            "psf/requests",
            "2.26",
            LogParser::PytestOptions,
            "pytest -rA",
        ),
        (
            "pylint-dev/pylint",
            "2.15",
            LogParser::PytestOptions,
            "pytest -rA",
        ),
        (
            "pydicom/pydicom",
            "2.3",
            LogParser::PytestOptions,
            "pytest -rA",
        ),
        (
            "scikit-learn/scikit-learn",
            "1.3",
            LogParser::PytestV2,
            "pytest -rA",
        ),
        ("pytest-dev/pytest", "8.0", LogParser::Pytest, "pytest -rA"),
        ("pydata/xarray", "2022.06", LogParser::Pytest, "pytest -rA"),
        ("pallets/flask", "2.3", LogParser::Pytest, "pytest -rA"),
        ("sqlfluff/sqlfluff", "1.4", LogParser::Pytest, "pytest -rA"),
        ("pvlib/pvlib-python", "0.9", LogParser::Pytest, "pytest -rA"),
        ("pyvista/pyvista", "0.43", LogParser::Pytest, "pytest -rA"),
        (
            "pylint-dev/astroid",
            "2.15",
            LogParser::Pytest,
            "pytest -rA",
        ),
        (
            "marshmallow-code/marshmallow",
            "3.0",
            LogParser::Pytest,
            "pytest -rA",
        ),
    ];
    for (repo, version, parser, cmd) in cases {
        let spec = spec_for(&task(repo, version)).unwrap();
        assert_eq!(spec.parser, Some(parser), "{repo}");
        assert!(spec.test_cmd.contains(cmd), "{repo}: {}", spec.test_cmd);
        // Non-Django repositories take the files as they are, less non-test files.
        assert_eq!(
            spec.directives,
            [
                "tests/admin_views/tests.py",
                "tests/i18n/sampleproject/templates/base.py"
            ],
            "{repo}"
        );
    }
    assert_eq!(HARNESS_SPECS.len(), 18);
    assert_eq!(SWEGYM_SPECS.len(), 11);
}

#[test]
fn a_known_repository_at_an_unknown_version_is_refused_with_the_known_ones() {
    let e = spec_for(&task("django/django", "0.1")).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("django__django-1"), "{msg}");
    assert!(msg.contains("\"0.1\""), "{msg}");
    assert!(msg.contains("3.0") && msg.contains("5.0"), "{msg}");
    let e = spec_for(&task("sympy/sympy", "")).unwrap_err();
    assert!(e.to_string().contains("`version` field is empty"), "{e}");
}

#[test]
fn a_task_command_wins_and_its_parser_is_named_or_the_repositorys() {
    let mut t = task("getmoto/moto", "4.1");
    t.test_cmd = "pytest -n0 -rA".into();
    let spec = spec_for(&t).unwrap();
    assert_eq!(spec.source, SpecSource::Task);
    assert_eq!(spec.parser, Some(LogParser::Pytest));
    assert_eq!(spec.activate, None);
    t.log_parser = "parse_log_pytest_v2".into();
    assert_eq!(spec_for(&t).unwrap().parser, Some(LogParser::PytestV2));
    t.log_parser = "django/django".into();
    assert_eq!(spec_for(&t).unwrap().parser, Some(LogParser::Django));
    t.log_parser = "parse_log_scikit".into();
    assert_eq!(spec_for(&t).unwrap().parser, Some(LogParser::PytestV2));
    t.log_parser = "junit".into();
    let e = spec_for(&t).unwrap_err();
    assert!(
        e.to_string().contains("unknown log_parser \"junit\""),
        "{e}"
    );
    // A SWE-bench repository with its own command keeps the repository's parser.
    let mut t = task("django/django", "9.9");
    t.test_cmd = "./tests/runtests.py --verbosity 2".into();
    assert_eq!(spec_for(&t).unwrap().parser, Some(LogParser::Django));
}

#[test]
fn other_repositories_get_the_generic_pytest_grading() {
    let spec = spec_for(&task("toy/calc", "")).unwrap();
    assert_eq!(spec.source, SpecSource::Generic);
    assert_eq!(spec.parser, None);
    assert_eq!(spec.test_cmd, crate::grade::DEFAULT_TEST_CMD);
    // Every file of the test patch, as before.
    assert_eq!(spec.directives.len(), 3);
    assert_eq!(spec.prelude(), "");
}

#[test]
fn directives_follow_the_harness_regex() {
    let patch = "diff --git a/a b/c.py b/a b/c.py\n+ diff --git a/x b/y.txt\n+diff --git a/q\ndiff --git a/d.csv b/d.csv\n";
    // The last " b/" of a line; a hunk line that quotes a header counts too (the harness
    // scans the whole text); non-test endings go.
    assert_eq!(test_directives("x/y", patch), ["c.py"]);
    assert_eq!(
        test_directives(
            "django/django",
            "diff --git a/tests/a/b.py b/tests/a/b.py\n"
        ),
        ["a.b"]
    );
    assert_eq!(
        test_directives("django/django", "diff --git a/django/x.py b/django/x.py\n"),
        ["django.x"]
    );
}

fn statuses(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn resolution_follows_the_harness_rules() {
    let mut t = task("pallets/flask", "2.3");
    t.fail_to_pass = vec!["a".into(), "b".into()];
    t.pass_to_pass = vec!["p".into(), "s".into()];
    let r = |pairs: &[(&str, &str)]| TestsReport::new(&t, &statuses(pairs)).resolution();
    assert_eq!(
        r(&[
            ("a", "PASSED"),
            ("b", "XFAIL"),
            ("p", "PASSED"),
            ("s", "PASSED")
        ]),
        Resolution::Full
    );
    // A skipped PASS_TO_PASS test counts neither way; so does a skipped FAIL_TO_PASS one.
    assert_eq!(
        r(&[
            ("a", "PASSED"),
            ("b", "SKIPPED"),
            ("p", "PASSED"),
            ("s", "SKIPPED")
        ]),
        Resolution::Full
    );
    assert_eq!(
        r(&[
            ("a", "PASSED"),
            ("b", "FAILED"),
            ("p", "PASSED"),
            ("s", "PASSED")
        ]),
        Resolution::Partial
    );
    // A missing test is a failure.
    assert_eq!(
        r(&[("a", "PASSED"), ("b", "PASSED"), ("p", "PASSED")]),
        Resolution::No
    );
    assert_eq!(
        r(&[
            ("a", "PASSED"),
            ("b", "PASSED"),
            ("p", "ERROR"),
            ("s", "PASSED")
        ]),
        Resolution::No
    );
    assert_eq!(r(&[]), Resolution::No);
    assert_eq!(Resolution::Partial.name(), "RESOLVED_PARTIAL");
}

#[test]
fn swegym_repositories_get_their_forks_specs() {
    let cases = [
        ("getmoto/moto", "4.1", LogParser::Pytest, "pytest -n0 -rA"),
        // The dataset spells it so; the fork also keys it lowercased.
        (
            "Project-MONAI/MONAI",
            "1.3",
            LogParser::Pytest,
            "pytest -rA",
        ),
        (
            "project-monai/monai",
            "0.105",
            LogParser::Pytest,
            "pytest -rA",
        ),
        (
            "pandas-dev/pandas",
            "2.2",
            LogParser::Pytest,
            "pytest -rA --tb=long",
        ),
        ("iterative/dvc", "3.49", LogParser::Pytest, "pytest -rA"),
        ("iterative/dvc", "0.12", LogParser::Pytest, "pytest -rA"),
        (
            "conan-io/conan",
            "1.60",
            LogParser::Pytest,
            "pytest -n0 -rA",
        ),
        (
            "pydantic/pydantic",
            "2.01",
            LogParser::PytestPydantic,
            "--tb=short -vv -o console_output_style=classic --no-header",
        ),
        ("dask/dask", "2022.6", LogParser::Pytest, "--color=no"),
        ("dask/dask", "2021.07", LogParser::Pytest, "--color=no"),
        (
            "modin-project/modin",
            "0.25",
            LogParser::Pytest,
            "pytest -n0 -rA",
        ),
        (
            "facebookresearch/hydra",
            "1.1",
            LogParser::Pytest,
            "--tb=long",
        ),
        (
            "bokeh/bokeh",
            "0.1181316818",
            LogParser::Pytest,
            "pytest -rA -n0",
        ),
    ];
    for (repo, version, parser, cmd) in cases {
        let spec =
            spec_for(&task(repo, version)).unwrap_or_else(|e| panic!("{repo} {version}: {e}"));
        assert_eq!(spec.source, SpecSource::Harness, "{repo}");
        assert_eq!(spec.parser, Some(parser), "{repo}");
        assert!(spec.test_cmd.contains(cmd), "{repo}: {}", spec.test_cmd);
        assert_eq!(spec.activate.as_deref(), Some(CONDA_ACTIVATE), "{repo}");
    }
    let conan = spec_for(&task("conan-io/conan", "2.0")).unwrap();
    assert_eq!(
        conan.eval_commands,
        ["export PYTHONPATH=${PYTHONPATH:-}:$(pwd)"]
    );
    assert!(conan.install.unwrap().contains("PIP_CONSTRAINT"));
    // The fork's install strings, byte for byte (checked against its constants.py).
    let hydra = spec_for(&task("facebookresearch/hydra", "1.1")).unwrap();
    assert!(hydra
        .install
        .unwrap()
        .starts_with("sed -i 's|isort@git+git://github.com/timothycrosley/isort|"));
    assert!(spec_for(&task("getmoto/moto", "9.9")).is_err());
}

/// mypy's tests are data-driven `[case NAME]` blocks: the fork selects the test patch's
/// cases with `-k "a or b"` instead of passing files.
#[test]
fn mypy_selects_the_test_patchs_cases_by_name() {
    let mut t = task("python/mypy", "1.8");
    t.test_patch =
        "diff --git a/test-data/unit/check-final.test b/test-data/unit/check-final.test\n\
                    @@ -1,3 +1,9 @@\n\
                    +[case testFinalOverload]\n\
                    +x = 1\n\
                     [case testFinalDefiningModuleVar]\n\
                    -[case testRemoved-skip]\n"
            .into();
    let spec = spec_for(&t).unwrap();
    assert_eq!(
        spec.directives,
        ["testFinalOverload or testFinalDefiningModuleVar or testRemoved-skip"]
    );
    assert_eq!(
        spec.test_command(),
        "pytest -rA -k 'testFinalOverload or testFinalDefiningModuleVar or testRemoved-skip'"
    );
    // A mypy task that brings its own command (SWE-rebench) gets files, as any other.
    t.test_cmd = "pytest -rA".into();
    let own = spec_for(&t).unwrap();
    assert_eq!(own.directives, ["test-data/unit/check-final.test"]);
    let old = spec_for(&task("python/mypy", "0.800")).unwrap();
    assert_eq!(old.test_cmd, "pytest -n0 -rA -k");
}
