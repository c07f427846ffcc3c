//! The operator dashboard (`deploy/grafana/tutor.json`) stays honest: every metric its
//! queries name is one the coordinator really serves at `/metrics` (learned by scraping
//! the real endpoint in-process, not from a copied list), counters are only read through
//! `rate`/`irate`/`increase` and gauges never are, every panel queries the `$datasource`
//! variable, panel ids are unique, and at least 80% of the exported metric families are
//! on it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tutor_coordinator::metrics::{self, MetricsSource};
use tutor_coordinator::run_events::EventLog;
use tutor_coordinator::scheduler::SchedulerHandle;
use tutor_proto::auth::ServerAuth;

const DASHBOARD: &str = include_str!("../../deploy/grafana/tutor.json");

/// The least share of exported metric families the dashboard must show.
const MIN_COVERAGE: f64 = 0.8;

/// The datasource every panel and query must use: the dashboard's variable.
const DATASOURCE_VARIABLE: &str = "datasource";

/// Metric family name -> Prometheus type (`counter`, `gauge`, `histogram`, ...), from the
/// `# TYPE` lines of a real scrape of the coordinator's `/metrics` endpoint. The event
/// log holds one finished iteration, so the per-iteration gauges are there too.
async fn exported_metrics() -> BTreeMap<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let addr_file = dir.path().join("metrics.addr");
    let source = MetricsSource {
        scheduler: SchedulerHandle::spawn(Default::default(), vec![], vec![]),
        events: Default::default(),
        auth: ServerAuth::new(None),
        run_events: EventLog::with_history(vec![tutor_proto::IterationSummary::default()]),
        require_token: false,
    };
    let task = metrics::start("127.0.0.1:0".parse().unwrap(), Some(&addr_file), source)
        .await
        .unwrap();
    let addr: SocketAddr = std::fs::read_to_string(&addr_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: dashboard-test\r\n\r\n")
        .await
        .unwrap();
    let mut page = String::new();
    stream.read_to_string(&mut page).await.unwrap();
    task.abort();
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    let (_, body) = page.split_once("\r\n\r\n").unwrap();
    let types: BTreeMap<String, String> = body
        .lines()
        .filter_map(|l| {
            let mut words = l.strip_prefix("# TYPE ")?.split_whitespace();
            Some((words.next()?.to_string(), words.next()?.to_string()))
        })
        .collect();
    assert!(!types.is_empty(), "no # TYPE lines in\n{body}");
    types
}

/// What a dashboard that passes [`check`] shows of the exported families.
#[derive(Debug)]
struct Coverage {
    used: BTreeSet<String>,
    unused: Vec<String>,
}

/// The identifiers starting `tutor_` in a PromQL expression that are metric names (not
/// inside a quoted string such as a label value), with their byte offsets.
fn metric_names(expr: &str) -> Vec<(usize, &str)> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut quote: Option<char> = None;
    let mut chars = expr.char_indices().peekable();
    let mut prev: Option<char> = None;
    while let Some((i, c)) = chars.next() {
        if let Some(q) = quote {
            if c == '\\' && q != '`' {
                chars.next();
            } else if c == q {
                quote = None;
            }
            prev = Some(c);
            continue;
        }
        if matches!(c, '"' | '\'' | '`') {
            quote = Some(c);
        } else if !prev.is_some_and(ident) && expr[i..].starts_with("tutor_") {
            let end = expr[i..]
                .find(|c: char| !ident(c))
                .map_or(expr.len(), |n| i + n);
            out.push((i, &expr[i..end]));
            while chars.peek().is_some_and(|&(j, _)| j < end) {
                chars.next();
            }
            prev = Some('_');
            continue;
        }
        prev = Some(c);
    }
    out
}

/// The function whose first argument is the metric at `at` in `expr` (`rate` in
/// `rate(tutor_x[5m])`), if any.
fn enclosing_function(expr: &str, at: usize) -> Option<&str> {
    let before = expr[..at].trim_end().strip_suffix('(')?.trim_end();
    let start = before
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    Some(&before[start..]).filter(|f| !f.is_empty())
}

/// Functions that turn a counter into a per-second or per-window figure.
const COUNTER_FUNCTIONS: [&str; 3] = ["rate", "irate", "increase"];

/// Whether `ds` is `{"type": "prometheus", "uid": "${datasource}"}` (or `$datasource`).
fn is_variable_datasource(ds: Option<&Value>) -> bool {
    let uid = ds.and_then(|d| d.get("uid")).and_then(Value::as_str);
    let kind = ds.and_then(|d| d.get("type")).and_then(Value::as_str);
    let var = format!("${DATASOURCE_VARIABLE}");
    let braced = format!("${{{DATASOURCE_VARIABLE}}}");
    kind == Some("prometheus") && (uid == Some(var.as_str()) || uid == Some(braced.as_str()))
}

/// Every panel, the ones inside collapsed rows included.
fn all_panels(panels: &[Value]) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in panels {
        out.push(p);
        if let Some(nested) = p.get("panels").and_then(Value::as_array) {
            out.extend(all_panels(nested));
        }
    }
    out
}

/// Checks a dashboard JSON model against the exported metric families; every problem
/// found is listed in the error.
fn check(dashboard: &str, exported: &BTreeMap<String, String>) -> Result<Coverage, Vec<String>> {
    let d: Value = serde_json::from_str(dashboard).map_err(|e| vec![format!("not JSON: {e}")])?;
    let mut errors = Vec::new();
    let mut exprs: Vec<(String, String)> = Vec::new(); // (where, PromQL)

    let vars = d["templating"]["list"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let has_ds_var = vars.iter().any(|v| {
        v["name"] == DATASOURCE_VARIABLE && v["type"] == "datasource" && v["query"] == "prometheus"
    });
    if !has_ds_var {
        errors.push(format!(
            "no templating variable `{DATASOURCE_VARIABLE}` of type datasource (prometheus)"
        ));
    }
    for v in vars.iter().filter(|v| v["type"] == "query") {
        let name = v["name"].as_str().unwrap_or("?");
        if !is_variable_datasource(v.get("datasource")) {
            errors.push(format!(
                "variable `{name}`: datasource is not ${DATASOURCE_VARIABLE}"
            ));
        }
        let q = v["query"].as_str().or_else(|| v["query"]["query"].as_str());
        exprs.push((
            format!("variable `{name}`"),
            q.unwrap_or_default().to_string(),
        ));
    }
    for a in d["annotations"]["list"].as_array().into_iter().flatten() {
        if let Some(e) = a.get("expr").and_then(Value::as_str) {
            let name = a["name"].as_str().unwrap_or("?");
            if !is_variable_datasource(a.get("datasource")) {
                errors.push(format!(
                    "annotation `{name}`: datasource is not ${DATASOURCE_VARIABLE}"
                ));
            }
            exprs.push((format!("annotation `{name}`"), e.to_string()));
        }
    }

    let top = d["panels"].as_array().cloned().unwrap_or_default();
    if top.is_empty() {
        errors.push("no panels".into());
    }
    let mut ids = BTreeSet::new();
    for p in all_panels(&top) {
        let title = p["title"].as_str().unwrap_or_default();
        let at = format!("panel {} `{title}`", p["id"]);
        if title.trim().is_empty() {
            errors.push(format!("{at}: no title"));
        }
        match p["id"].as_u64() {
            Some(id) if !ids.insert(id) => errors.push(format!("{at}: duplicate id {id}")),
            Some(_) => {}
            None => errors.push(format!("{at}: no numeric id")),
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if p["type"] == "row" {
            if !targets.is_empty() {
                errors.push(format!("{at}: a row with queries"));
            }
            continue;
        }
        if !is_variable_datasource(p.get("datasource")) {
            errors.push(format!("{at}: datasource is not ${DATASOURCE_VARIABLE}"));
        }
        if targets.is_empty() {
            errors.push(format!("{at}: no queries"));
        }
        for t in &targets {
            let r = t["refId"].as_str().unwrap_or("?");
            if t.get("datasource").is_some() && !is_variable_datasource(t.get("datasource")) {
                errors.push(format!(
                    "{at} query {r}: datasource is not ${DATASOURCE_VARIABLE}"
                ));
            }
            match t["expr"].as_str() {
                Some(e) if !e.trim().is_empty() => {
                    exprs.push((format!("{at} query {r}"), e.into()))
                }
                _ => errors.push(format!("{at} query {r}: no expr")),
            }
        }
    }

    let mut used = BTreeSet::new();
    for (at, expr) in &exprs {
        let names = metric_names(expr);
        if names.is_empty() {
            errors.push(format!("{at}: `{expr}` names no tutor_ metric"));
        }
        for (offset, name) in names {
            // A histogram or summary is exported as one family and read through its
            // _bucket/_sum/_count series.
            let family = if exported.contains_key(name) {
                Some(name)
            } else {
                ["_bucket", "_sum", "_count"].iter().find_map(|s| {
                    let base = name.strip_suffix(s)?;
                    let kind = exported.get(base)?;
                    (kind == "histogram" || kind == "summary").then_some(base)
                })
            };
            let Some(family) = family else {
                errors.push(format!("{at}: `{name}` is not exported by the coordinator"));
                continue;
            };
            used.insert(family.to_string());
            // A raw counter only grows; the rate of a gauge means nothing. A variable
            // may list a counter's label values.
            let f = enclosing_function(expr, offset).unwrap_or_default();
            let under_rate = COUNTER_FUNCTIONS.contains(&f);
            match exported[family].as_str() {
                "counter" if !under_rate && f != "label_values" => errors.push(format!(
                    "{at}: counter `{name}` must be read through rate(...) or increase(...)"
                )),
                "gauge" if under_rate => {
                    errors.push(format!("{at}: gauge `{name}` under {f}(...)"))
                }
                _ => {}
            }
        }
    }

    let unused: Vec<String> = exported
        .keys()
        .filter(|k| !used.contains(*k))
        .cloned()
        .collect();
    let coverage = used.len() as f64 / exported.len().max(1) as f64;
    if coverage < MIN_COVERAGE {
        errors.push(format!(
            "the dashboard shows {} of {} exported metric families ({:.0}% < {:.0}%); missing: {}",
            used.len(),
            exported.len(),
            coverage * 100.0,
            MIN_COVERAGE * 100.0,
            unused.join(", ")
        ));
    }
    if errors.is_empty() {
        Ok(Coverage { used, unused })
    } else {
        Err(errors)
    }
}

#[tokio::test]
async fn dashboard_uses_only_metrics_the_coordinator_exports() {
    let exported = exported_metrics().await;
    let coverage = check(DASHBOARD, &exported)
        .unwrap_or_else(|errors| panic!("deploy/grafana/tutor.json:\n  {}", errors.join("\n  ")));
    println!(
        "dashboard shows {} of {} exported metric families",
        coverage.used.len(),
        exported.len()
    );
    for name in &coverage.unused {
        println!("exported but on no panel: {name} ({})", exported[name]);
    }
}

/// The checker fails on each kind of rot it is there to catch.
#[tokio::test]
async fn check_rejects_a_dashboard_that_drifted() {
    let exported = exported_metrics().await;
    let good: Value = serde_json::from_str(DASHBOARD).unwrap();
    let must_fail = |d: &str, needle: &str| {
        let errors = check(d, &exported).expect_err(needle);
        assert!(
            errors.iter().any(|e| e.contains(needle)),
            "expected an error with `{needle}`, got {errors:#?}"
        );
    };

    // A misspelt metric name.
    let target = "tutor_coordinator_queue_depth";
    assert!(DASHBOARD.contains(target));
    let misspelt = DASHBOARD.replacen(target, "tutor_coordinator_queue_depht", 1);
    must_fail(&misspelt, "`tutor_coordinator_queue_depht` is not exported");

    // A histogram suffix on a metric that is no histogram.
    let suffixed = DASHBOARD.replacen(target, "tutor_coordinator_queue_depth_bucket", 1);
    must_fail(
        &suffixed,
        "`tutor_coordinator_queue_depth_bucket` is not exported",
    );

    // A counter plotted raw (an ever-growing line), and a gauge under rate().
    let raw = DASHBOARD.replacen(
        "rate(tutor_coordinator_lease_expiries_total{instance=~\\\"$instance\\\"}[5m])",
        "tutor_coordinator_lease_expiries_total{instance=~\\\"$instance\\\"}",
        1,
    );
    assert_ne!(
        raw, DASHBOARD,
        "the lease expiries query changed: update this test"
    );
    must_fail(&raw, "counter `tutor_coordinator_lease_expiries_total`");
    let gauge_rate = DASHBOARD.replacen(
        "sum(tutor_coordinator_queue_depth{instance=~\\\"$instance\\\"})",
        "sum(rate(tutor_coordinator_queue_depth{instance=~\\\"$instance\\\"}[5m]))",
        1,
    );
    assert_ne!(
        gauge_rate, DASHBOARD,
        "the queue depth query changed: update this test"
    );
    must_fail(
        &gauge_rate,
        "gauge `tutor_coordinator_queue_depth` under rate",
    );

    // A hard-wired datasource, a missing title, a duplicate id.
    let mut d = good.clone();
    let p = d["panels"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["type"] != "row")
        .unwrap();
    p["datasource"] = serde_json::json!({"type": "prometheus", "uid": "P1809F7CD0C75ACF3"});
    p["title"] = "".into();
    let id = p["id"].clone();
    d["panels"][0]["id"] = id;
    let d = d.to_string();
    must_fail(&d, "datasource is not $datasource");
    must_fail(&d, "no title");
    must_fail(&d, "duplicate id");

    // Too few of the exported families on the dashboard: keep the first panel only.
    let mut d = good.clone();
    let first = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["type"] != "row")
        .cloned()
        .unwrap();
    d["panels"] = Value::Array(vec![first]);
    must_fail(&d.to_string(), "exported metric families");

    // Quoted strings are not metric names; names run to the end of the identifier.
    assert_eq!(
        metric_names(r#"sum(rate(tutor_a_total{job="tutor_b"}[5m])) / tutor_c:d"#),
        vec![(9, "tutor_a_total"), (46, "tutor_c:d")]
    );
    assert!(metric_names("my_tutor_x").is_empty());
    let e = "sum(irate( tutor_a[5m])) + label_values(tutor_b, instance) + tutor_c";
    assert_eq!(
        enclosing_function(e, e.find("tutor_a").unwrap()),
        Some("irate")
    );
    assert_eq!(
        enclosing_function(e, e.find("tutor_b").unwrap()),
        Some("label_values")
    );
    assert_eq!(enclosing_function(e, e.find("tutor_c").unwrap()), None);
}
