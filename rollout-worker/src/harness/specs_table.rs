// The SWE-bench harness's Python specs (test command, eval commands, install), grouped
// by the versions that share them. Included by harness/mod.rs.
[
    RepoSpecs {
        repo: "astropy/astropy",
        parser: LogParser::PytestV2,
        groups: &[
            VersionSpec {
                versions: &["3.0", "3.1", "3.2", "4.1", "4.2", "4.3", "5.0", "5.1", "5.2", "v5.3"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .[test] --verbose",
            },
            VersionSpec {
                versions: &["0.1", "0.2", "0.3", "0.4", "1.1", "1.2", "1.3"],
                test_cmd: "pytest -rA -vv -o console_output_style=classic --tb=no",
                eval_commands: &[],
                install: "python -m pip install -e .[test] --verbose",
            },
        ],
    },
    RepoSpecs {
        repo: "django/django",
        parser: LogParser::Django,
        groups: &[
            VersionSpec {
                versions: &["1.7", "1.8", "1.10", "1.11", "2.0", "2.1", "2.2"],
                test_cmd: "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
                eval_commands: &["export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8", "export PYTHONIOENCODING=utf8", "export LANGUAGE=en_US:en"],
                install: "python setup.py install",
            },
            VersionSpec {
                versions: &["1.9"],
                test_cmd: "./tests/runtests.py --verbosity 2",
                eval_commands: &["export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8", "export PYTHONIOENCODING=utf8", "export LANGUAGE=en_US:en"],
                install: "python setup.py install",
            },
            VersionSpec {
                versions: &["1.4", "1.5", "1.6"],
                test_cmd: "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
                eval_commands: &[],
                install: "python setup.py install",
            },
            VersionSpec {
                versions: &["3.0", "3.1", "3.2"],
                test_cmd: "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
                eval_commands: &["sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen", "export LANG=en_US.UTF-8", "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8"],
                install: "python -m pip install -e .",
            },
            VersionSpec {
                versions: &["4.0", "4.1", "4.2", "5.0", "5.1", "5.2"],
                test_cmd: "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "matplotlib/matplotlib",
        parser: LogParser::Matplotlib,
        groups: &[
            VersionSpec {
                versions: &["3.5", "3.6", "3.7", "3.1", "3.2", "3.3", "3.4", "3.0"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
            VersionSpec {
                versions: &["3.8", "3.9"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install --no-build-isolation -e \".[dev]\"",
            },
            VersionSpec {
                versions: &["2.0", "2.1", "2.2", "1.0", "1.1", "1.2", "1.3", "1.4", "1.5"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python setup.py build; python setup.py install",
            },
        ],
    },
    RepoSpecs {
        repo: "marshmallow-code/marshmallow",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["2.18", "2.19", "2.20", "3.0", "3.1", "3.10", "3.11", "3.12", "3.13", "3.15", "3.16", "3.19", "3.2", "3.4", "3.8", "3.9"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e '.[dev]'",
            },
        ],
    },
    RepoSpecs {
        repo: "mwaskom/seaborn",
        parser: LogParser::Seaborn,
        groups: &[
            VersionSpec {
                versions: &["0.11"],
                test_cmd: "pytest --no-header -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
            VersionSpec {
                versions: &["0.12", "0.13", "0.14"],
                test_cmd: "pytest --no-header -rA",
                eval_commands: &[],
                install: "python -m pip install -e .[dev]",
            },
        ],
    },
    RepoSpecs {
        repo: "pallets/flask",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["2.0", "2.1", "2.2", "2.3", "3.0", "3.1"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "psf/requests",
        parser: LogParser::PytestOptions,
        groups: &[
            VersionSpec {
                versions: &["0.7", "0.8", "0.9", "0.11", "0.13", "0.14", "1.1", "1.2", "2.0", "2.2", "2.3", "2.4", "2.5", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.17", "2.18", "2.19", "2.22", "2.26", "2.25", "2.27", "2.31", "3.0"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install .",
            },
        ],
    },
    RepoSpecs {
        repo: "pvlib/pvlib-python",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .[all]",
            },
        ],
    },
    RepoSpecs {
        repo: "pydata/xarray",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["0.12", "0.18", "0.19", "0.20", "2022.03", "2022.06", "2022.09", "2023.07", "2024.05"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "pydicom/pydicom",
        parser: LogParser::PytestOptions,
        groups: &[
            VersionSpec {
                versions: &["1.0", "1.1", "1.2", "1.3", "1.4", "2.0", "2.1", "2.2", "2.3", "2.4", "3.0"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "pylint-dev/astroid",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["2.10", "2.12", "2.13", "2.14", "2.15", "2.16", "2.5", "2.6", "2.7", "2.8", "2.9", "3.0"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "pylint-dev/pylint",
        parser: LogParser::PytestOptions,
        groups: &[
            VersionSpec {
                versions: &["2.10", "2.11", "2.13", "2.14", "2.15", "2.16", "2.17", "2.8", "2.9", "3.0", "3.1", "3.2", "3.3", "4.0"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "pytest-dev/pytest",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["4.4", "4.5", "4.6", "5.0", "5.1", "5.2", "5.3", "5.4", "6.0", "6.2", "6.3", "7.0", "7.1", "7.2", "7.4", "8.0", "8.1", "8.2", "8.3", "8.4"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "pyvista/pyvista",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["0.20", "0.21", "0.22", "0.23", "0.24", "0.25", "0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33", "0.34", "0.35", "0.36", "0.37", "0.38", "0.39", "0.40", "0.41", "0.42", "0.43"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "scikit-learn/scikit-learn",
        parser: LogParser::PytestV2,
        groups: &[
            VersionSpec {
                versions: &["0.20", "0.21", "0.22", "1.3", "1.4", "1.5", "1.6"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -v --no-use-pep517 --no-build-isolation -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "sphinx-doc/sphinx",
        parser: LogParser::PytestV2,
        groups: &[
            VersionSpec {
                versions: &["1.5", "1.6", "1.7", "1.8", "2.0", "2.1", "2.2", "2.3", "2.4", "3.0", "3.1", "3.2", "3.3", "3.4", "3.5", "4.0", "4.1", "4.2", "4.3", "4.4", "4.5", "5.0", "5.1", "5.2", "5.3", "6.0", "6.2", "7.0", "7.1", "7.2", "7.3", "7.4", "8.0", "8.1"],
                test_cmd: "tox --current-env -epy39 -v --",
                eval_commands: &[],
                install: "python -m pip install -e .[test]",
            },
        ],
    },
    RepoSpecs {
        repo: "sqlfluff/sqlfluff",
        parser: LogParser::Pytest,
        groups: &[
            VersionSpec {
                versions: &["0.10", "0.11", "0.12", "0.13", "0.4", "0.5", "0.6", "0.8", "0.9", "1.0", "1.1", "1.2", "1.3", "1.4", "2.0", "2.1", "2.2"],
                test_cmd: "pytest -rA",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
    RepoSpecs {
        repo: "sympy/sympy",
        parser: LogParser::Sympy,
        groups: &[
            VersionSpec {
                versions: &["0.7", "1.0", "1.1", "1.10", "1.11", "1.12", "1.2", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.13", "1.14"],
                test_cmd: "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
                eval_commands: &[],
                install: "python -m pip install -e .",
            },
        ],
    },
]
