//! The PNG plots `tutor report` writes into `DIR/plots/`: held-out solve rate, training
//! loss, and the student's disagreement with the teacher on the states it visited (the
//! DAgger paper's divergence figure), for one run or for an experiment's arms over seeds.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde_json::Value;

/// Every plot's size in pixels.
pub const PLOT_SIZE: (u32, u32) = (900, 600);
/// Names a font file (TrueType or OpenType) to draw the plots' text with.
pub const FONT_ENV: &str = "TUTOR_PLOT_FONT";
const FONT_FAMILY: &str = "sans-serif";
/// Where common systems keep a sans-serif TrueType font; the first is the Debian/Ubuntu
/// package `fonts-dejavu-core`, which `make setup` installs.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];
/// The file `tutor experiment` writes into an experiment directory.
pub const EXPERIMENT_RESULTS: &str = "results.json";

/// Colour per curve, in order (matplotlib's tab10, which readers know from papers).
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];
const GUIDE: RGBColor = RGBColor(150, 150, 150);
const BAND_ALPHA: f64 = 0.2;
const MESH: RGBColor = RGBColor(225, 225, 225);
/// The legend's sample of a band (its curves' own are their colours, as light).
const BAND: RGBColor = RGBColor(205, 205, 205);

/// Whether `dir` is an experiment directory (it holds results.json) rather than a run's.
pub fn is_experiment(dir: &Path) -> bool {
    dir.join(EXPERIMENT_RESULTS).is_file()
}

/// The held-out solve-rate panel (run and experiment plots alike): y fixed to 0..1.
fn solve_rate_panel(name: &str) -> Panel {
    let mut solve = Panel::new(
        format!("Held-out solve rate: {name}"),
        "iteration",
        "held-out solve rate",
    );
    solve.y_range = Some(0.0..1.0);
    solve.legend = SeriesLabelPosition::UpperLeft;
    solve
}

/// Writes one run's plots into `run_dir/plots/`; returns their paths.
pub fn write_run_plots(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let run = read_run(run_dir)?;
    let name = match &run.algorithm {
        Some(a) => format!("{} ({a})", dir_name(run_dir)),
        None => dir_name(run_dir),
    };
    let color = PALETTE[0];

    let mut solve = solve_rate_panel(&name);
    let points = run.series(|p| p.solve_rate);
    if let Some(f) = run
        .final_eval
        .as_ref()
        .and_then(|f| Some((f.iteration, f.solve_rate?)))
    {
        let (x, y) = (f64::from(f.0), f.1);
        solve.finals.push(FinalMark {
            color,
            from: points.last().copied(),
            x,
            y,
            low: y,
            high: y,
        });
    }
    solve
        .curves
        .push(Curve::line("held-out solve rate", color, points));

    let mut loss = Panel::new(
        format!("Training loss: {name}"),
        "iteration",
        "training loss",
    );
    if run.rows.iter().any(|r| !r.step_losses.is_empty()) {
        loss.x_desc = "optimizer step";
        let mut steps = Vec::new();
        let mut means = Vec::new();
        for r in run.rows.iter().filter(|r| !r.step_losses.is_empty()) {
            let start = steps.len() as f64 + 1.0;
            for l in &r.step_losses {
                steps.push((steps.len() as f64 + 1.0, *l));
            }
            let end = steps.len() as f64;
            if let Some(m) = r.train_loss {
                means.push((start, m));
                means.push((end, m));
            }
            loss.guides.push(end + 0.5);
        }
        loss.guides.pop();
        loss.guide_note = Some("iteration boundary");
        let mut per_step = Curve::line("loss per optimizer step", color, steps);
        per_step.markers = false;
        loss.curves.push(per_step);
        if !means.is_empty() {
            let mut mean = Curve::line("mean loss of the iteration", BLACK, means);
            mean.markers = false;
            mean.segments = true;
            loss.curves.push(mean);
        }
    } else {
        loss.curves.push(Curve::line(
            "mean loss per iteration",
            color,
            run.series(|p| p.train_loss),
        ));
        loss.x_extent = run.iterations();
    }

    let mut disagreement = disagreement_panel(&name);
    disagreement.curves.push(Curve::line(
        "student's command differs from the teacher's",
        color,
        run.series(|p| p.disagreement),
    ));
    let iterations = run.iterations();
    solve.x_extent = iterations.clone();
    disagreement.x_extent = iterations.clone();
    let mut plots = vec![("solve_rate.png", vec![solve]), ("loss.png", vec![loss])];
    let kl = run.series(|p| p.reverse_kl);
    if kl.is_empty() {
        plots.push(("disagreement.png", vec![disagreement]));
    } else {
        let mut panel = reverse_kl_panel(&name);
        panel.curves.push(Curve::line("reverse KL", color, kl));
        panel.x_extent = iterations;
        plots.push(("disagreement.png", vec![disagreement, panel]));
    }
    write_plots(run_dir, plots)
}

/// `tutor report` on an experiment directory: the per-arm table of results.json, then the
/// plots, one curve per arm (the mean over its seeds, a band from the lowest to the highest
/// seed), whose paths it prints.
pub fn experiment_report(dir: &Path) -> Result<()> {
    let results = read_results(dir)?;
    print!("{}", experiment_table(&results));
    for path in write_experiment_plots(dir, &results)? {
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// Writes an experiment's plots into `dir/plots/`; returns their paths. Runs whose status
/// is not "ok" are left out.
fn write_experiment_plots(dir: &Path, results: &ExperimentResults) -> Result<Vec<PathBuf>> {
    let mut arms: Vec<(String, Vec<RunCurves>)> = Vec::new();
    for run in results.runs.iter().filter(|r| r.ok()) {
        let run_dir = dir.join(&run.run_dir);
        let curves = read_run(&run_dir)?;
        if curves.rows.is_empty() {
            eprintln!(
                "note: {} has no metrics rows: arm {} seed {} is missing from the plots",
                run_dir.join("metrics.jsonl").display(),
                run.arm,
                run.seed.map_or("?".to_string(), |s| s.to_string())
            );
            continue;
        }
        match arms.iter_mut().find(|(arm, _)| *arm == run.arm) {
            Some((_, runs)) => runs.push(curves),
            None => arms.push((run.arm.clone(), vec![curves])),
        }
    }
    let name = if results.experiment.is_empty() {
        dir_name(dir)
    } else {
        results.experiment.clone()
    };
    let mut solve = solve_rate_panel(&name);
    let mut loss = Panel::new(
        format!("Training loss: {name}"),
        "iteration",
        "mean training loss",
    );
    let mut disagreement = disagreement_panel(&name);
    let mut kl = reverse_kl_panel(&name);
    for (i, (arm, runs)) in arms.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let label = format!("{arm} (mean of {} seeds)", runs.len());
        let solve_curve = Curve::across_seeds(&label, color, runs, |p| p.solve_rate);
        for (x, s) in across_seeds(runs.iter().filter_map(|r| {
            let f = r.final_eval.as_ref()?;
            Some((f.iteration, f.solve_rate?))
        })) {
            solve.finals.push(FinalMark {
                color,
                from: solve_curve.points.last().copied(),
                x,
                y: s.mean,
                low: s.min,
                high: s.max,
            });
        }
        solve.curves.push(solve_curve);
        loss.curves
            .push(Curve::across_seeds(&label, color, runs, |p| p.train_loss));
        disagreement
            .curves
            .push(Curve::across_seeds(&label, color, runs, |p| p.disagreement));
        kl.curves
            .push(Curve::across_seeds(&label, color, runs, |p| p.reverse_kl));
    }
    let iterations: Vec<f64> = arms
        .iter()
        .flat_map(|(_, runs)| runs.iter().flat_map(RunCurves::iterations))
        .collect();
    for p in [&mut solve, &mut loss, &mut disagreement, &mut kl] {
        if p.curves.iter().any(|c| c.band.iter().any(|b| b.2 > b.1)) {
            p.band_note = Some("band: lowest to highest seed");
        }
        p.x_extent = iterations.clone();
    }
    let disagreement = if kl.curves.iter().any(|c| !c.points.is_empty()) {
        vec![disagreement, kl]
    } else {
        vec![disagreement]
    };
    write_plots(
        dir,
        vec![
            ("solve_rate.png", vec![solve]),
            ("loss.png", vec![loss]),
            ("disagreement.png", disagreement),
        ],
    )
}

fn disagreement_panel(name: &str) -> Panel {
    let mut p = Panel::new(
        format!("Disagreement with the teacher on student-visited states: {name}"),
        "iteration",
        "disagreement rate",
    );
    p.y_range = Some(0.0..1.0);
    p
}

fn reverse_kl_panel(name: &str) -> Panel {
    Panel::new(
        format!("Reverse KL(student || teacher): {name}"),
        "iteration",
        "reverse KL",
    )
}

/// One metrics row's plotted values; a field the row lacks (a run older than the field)
/// is None, and the plots leave that point out.
#[derive(Clone, Debug, Default, PartialEq)]
struct IterationPoint {
    iteration: u32,
    solve_rate: Option<f64>,
    train_loss: Option<f64>,
    step_losses: Vec<f64>,
    disagreement: Option<f64>,
    reverse_kl: Option<f64>,
}

impl IterationPoint {
    fn from_row(v: &Value) -> Option<Self> {
        let iteration = u32::try_from(v.get("iteration")?.as_u64()?).ok()?;
        let num = |k: &str| v.get(k).and_then(Value::as_f64).filter(|x| x.is_finite());
        let step_losses: Vec<f64> = v
            .get("step_losses")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_f64)
                    .filter(|x| x.is_finite())
                    .collect()
            })
            .unwrap_or_default();
        // An iteration that ran no held-out episodes measured no solve rate (the row says 0).
        let evaluated = v.get("heldout_episodes").and_then(Value::as_u64) != Some(0);
        let disagreement = match (num("disagreement_rate"), num("agreement_rate")) {
            // Both 0: the student visited no state (the teacher drove every turn).
            (Some(d), Some(a)) if d == 0.0 && a == 0.0 => None,
            (Some(d), _) => Some(d),
            // Rows older than `disagreement_rate` record its complement.
            (None, Some(a)) if a > 0.0 => Some(1.0 - a),
            _ => None,
        };
        Some(Self {
            iteration,
            solve_rate: num("heldout_solve_rate").filter(|_| evaluated),
            train_loss: num("train_loss").or_else(|| mean(&step_losses)),
            step_losses,
            disagreement,
            reverse_kl: num("reverse_kl"),
        })
    }
}

/// What a run directory records for the plots: metrics.jsonl's rows (the last row of a
/// repeated iteration, as `read_summaries` keeps) and final_eval.json.
#[derive(Debug, Default)]
struct RunCurves {
    rows: Vec<IterationPoint>,
    final_eval: Option<IterationPoint>,
    algorithm: Option<String>,
}

impl RunCurves {
    /// The iterations metrics.jsonl records, as x values.
    fn iterations(&self) -> Vec<f64> {
        self.rows.iter().map(|p| f64::from(p.iteration)).collect()
    }

    fn series(&self, metric: impl Fn(&IterationPoint) -> Option<f64>) -> Vec<(f64, f64)> {
        self.rows
            .iter()
            .filter_map(|p| Some((f64::from(p.iteration), metric(p)?)))
            .collect()
    }
}

/// Reads a run directory's curves; a missing file is an empty run and a line that is not
/// a row (torn by a crash) is skipped, so an unfinished run still plots.
fn read_run(run_dir: &Path) -> Result<RunCurves> {
    let path = run_dir.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut rows = BTreeMap::new();
    let mut algorithm = None;
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let Some(p) = IterationPoint::from_row(&v) {
            rows.insert(p.iteration, p);
        }
        if let Some(a) = v.get("algorithm").and_then(Value::as_str) {
            algorithm = Some(a.to_string());
        }
    }
    let final_eval = std::fs::read_to_string(run_dir.join("final_eval.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| IterationPoint::from_row(&v));
    Ok(RunCurves {
        rows: rows.into_values().collect(),
        final_eval,
        algorithm,
    })
}

/// `results.json` of an experiment directory, as `tutor experiment` writes it.
#[derive(Debug, Deserialize)]
struct ExperimentResults {
    #[serde(default)]
    experiment: String,
    #[serde(default)]
    runs: Vec<ExperimentRun>,
}

#[derive(Debug, Deserialize)]
struct ExperimentRun {
    arm: String,
    #[serde(default)]
    seed: Option<u64>,
    /// Relative to the experiment directory, or absolute.
    run_dir: PathBuf,
    #[serde(default)]
    status: String,
    #[serde(default)]
    error: String,
    #[serde(default)]
    final_heldout_solve_rate: Option<f64>,
    #[serde(default)]
    teacher_labels: Option<f64>,
    #[serde(default)]
    wall_seconds: Option<f64>,
}

impl ExperimentRun {
    fn ok(&self) -> bool {
        self.status == "ok"
    }
}

fn read_results(dir: &Path) -> Result<ExperimentResults> {
    let path = dir.join(EXPERIMENT_RESULTS);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected {{\"experiment\": ..., \"runs\": [{{\"arm\", \"seed\", \"run_dir\", \
             \"status\", ...}}]}} as `tutor experiment` writes it",
            path.display()
        )
    })
}

/// One line per arm (in results.json's order): runs that finished, the final held-out
/// solve rate's mean ± sample std over them, mean teacher labels and wall time; then the
/// runs left out and why.
fn experiment_table(results: &ExperimentResults) -> String {
    let mut arms: Vec<&str> = Vec::new();
    for r in &results.runs {
        if !arms.contains(&r.arm.as_str()) {
            arms.push(&r.arm);
        }
    }
    let ok = results.runs.iter().filter(|r| r.ok()).count();
    let mut out = format!(
        "experiment {}: {} runs, {ok} ok\n{:<24} {:>7} {:>18} {:>15} {:>10}\n",
        results.experiment,
        results.runs.len(),
        "arm",
        "ok/runs",
        "final solve rate",
        "teacher labels",
        "wall (s)"
    );
    for arm in arms {
        let runs: Vec<&ExperimentRun> = results.runs.iter().filter(|r| r.arm == arm).collect();
        let done: Vec<&&ExperimentRun> = runs.iter().filter(|r| r.ok()).collect();
        let of = |f: fn(&ExperimentRun) -> Option<f64>| -> Vec<f64> {
            done.iter()
                .filter_map(|r| f(r))
                .filter(|x| x.is_finite())
                .collect()
        };
        let solve = Stats::of(&of(|r| r.final_heldout_solve_rate));
        let labels = Stats::of(&of(|r| r.teacher_labels));
        let wall = Stats::of(&of(|r| r.wall_seconds));
        out.push_str(&format!(
            "{arm:<24} {:>7} {:>18} {:>15} {:>10}\n",
            format!("{}/{}", done.len(), runs.len()),
            solve.map_or("n/a".into(), |s| format!("{:.3} ± {:.3}", s.mean, s.std)),
            labels.map_or("n/a".into(), |s| format!("{:.0}", s.mean)),
            wall.map_or("n/a".into(), |s| format!("{:.1}", s.mean)),
        ));
    }
    out.push_str("(final solve rate: mean ± sample std over the arm's ok runs)\n");
    for r in results.runs.iter().filter(|r| !r.ok()) {
        out.push_str(&format!(
            "left out: {} seed {} ({}): status {:?}{}\n",
            r.arm,
            r.seed.map_or("?".to_string(), |s| s.to_string()),
            r.run_dir.display(),
            r.status,
            if r.error.is_empty() {
                String::new()
            } else {
                format!(", {}", r.error)
            }
        ));
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Stats {
    mean: f64,
    /// Sample standard deviation (0 for one value).
    std: f64,
    min: f64,
    max: f64,
}

impl Stats {
    fn of(values: &[f64]) -> Option<Stats> {
        let n = values.len() as f64;
        let mean = mean(values)?;
        let std = if values.len() > 1 {
            (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Some(Stats {
            mean,
            std,
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// The statistics over seeds of (iteration, value) pairs, per iteration in order.
fn across_seeds(values: impl Iterator<Item = (u32, f64)>) -> Vec<(f64, Stats)> {
    let mut by_x: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for (x, v) in values {
        by_x.entry(x).or_default().push(v);
    }
    by_x.into_iter()
        .filter_map(|(x, vs)| Some((f64::from(x), Stats::of(&vs)?)))
        .collect()
}

/// One curve of a panel: a line through `points`, and a shaded band where `band` gives
/// each x its (low, high).
struct Curve {
    label: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    band: Vec<(f64, f64, f64)>,
    markers: bool,
    /// Draw `points` as separate segments, two points each, instead of one line.
    segments: bool,
}

impl Curve {
    fn line(label: &str, color: RGBColor, points: Vec<(f64, f64)>) -> Curve {
        Curve {
            label: label.to_string(),
            color,
            points,
            band: Vec::new(),
            markers: true,
            segments: false,
        }
    }

    fn across_seeds(
        label: &str,
        color: RGBColor,
        runs: &[RunCurves],
        metric: impl Fn(&IterationPoint) -> Option<f64>,
    ) -> Curve {
        let stats = across_seeds(
            runs.iter()
                .flat_map(|r| r.rows.iter())
                .filter_map(|p| Some((p.iteration, metric(p)?))),
        );
        let mut c = Curve::line(
            label,
            color,
            stats.iter().map(|(x, s)| (*x, s.mean)).collect(),
        );
        c.band = stats.iter().map(|(x, s)| (*x, s.min, s.max)).collect();
        c
    }
}

/// The final held-out evaluation: a triangle at (x, y), a bar from low to high (the seeds'
/// spread), and a dashed line from the curve's last point.
struct FinalMark {
    color: RGBColor,
    from: Option<(f64, f64)>,
    x: f64,
    y: f64,
    low: f64,
    high: f64,
}

/// One chart: a PNG holds one, or several stacked.
struct Panel {
    title: String,
    x_desc: &'static str,
    y_desc: &'static str,
    /// None: fitted to the data.
    y_range: Option<Range<f64>>,
    curves: Vec<Curve>,
    finals: Vec<FinalMark>,
    /// Vertical grey lines (the iterations' ends on a per-step axis), and their legend.
    guides: Vec<f64>,
    guide_note: Option<&'static str>,
    /// The legend's words for the curves' shaded bands.
    band_note: Option<&'static str>,
    legend: SeriesLabelPosition,
    /// x values the axis spans even where no curve reaches (every iteration of the run).
    x_extent: Vec<f64>,
}

impl Panel {
    fn new(title: String, x_desc: &'static str, y_desc: &'static str) -> Panel {
        Panel {
            title,
            x_desc,
            y_desc,
            y_range: None,
            curves: Vec::new(),
            finals: Vec::new(),
            guides: Vec::new(),
            guide_note: None,
            band_note: None,
            legend: SeriesLabelPosition::UpperRight,
            x_extent: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.curves.iter().all(|c| c.points.is_empty()) && self.finals.is_empty()
    }

    fn xs(&self) -> impl Iterator<Item = f64> + '_ {
        let curves = self
            .curves
            .iter()
            .flat_map(|c| c.points.iter().map(|p| p.0));
        let finals = self.finals.iter().map(|f| f.x);
        curves.chain(finals).chain(self.x_extent.iter().copied())
    }

    fn ys(&self) -> impl Iterator<Item = f64> + '_ {
        let curves = self.curves.iter().flat_map(|c| {
            let band = c.band.iter().flat_map(|b| [b.1, b.2]);
            c.points.iter().map(|p| p.1).chain(band)
        });
        curves.chain(self.finals.iter().flat_map(|f| [f.y, f.low, f.high]))
    }
}

/// Writes each (file name, panels) as `dir/plots/<file name>`, the panels stacked.
fn write_plots(dir: &Path, plots: Vec<(&str, Vec<Panel>)>) -> Result<Vec<PathBuf>> {
    register_font()?;
    let out = dir.join("plots");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    for (file, panels) in plots {
        let path = out.join(file);
        draw_png(&path, &panels).with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn draw_png(path: &Path, panels: &[Panel]) -> Result<()> {
    let root = BitMapBackend::new(path, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    // Stacked panels share the x axis, so their iterations line up.
    let xs = span(panels.iter().flat_map(Panel::xs), 1.0);
    for (area, panel) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
        draw_panel(area, panel, xs)?;
    }
    root.present()?;
    Ok(())
}

fn draw_panel(
    area: &DrawingArea<BitMapBackend, Shift>,
    p: &Panel,
    (x0, x1): (f64, f64),
) -> Result<()> {
    let pad = (x1 - x0) * 0.02;
    let y = p.y_range.clone().unwrap_or_else(|| {
        let (y0, y1) = span(p.ys(), 0.0);
        let pad = ((y1 - y0) * 0.05).max(1e-6);
        (y0 - pad)..(y1 + pad)
    });
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, (FONT_FAMILY, 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), y.clone())?;
    chart
        .configure_mesh()
        .x_desc(p.x_desc)
        .y_desc(p.y_desc)
        .axis_desc_style((FONT_FAMILY, 17))
        .label_style((FONT_FAMILY, 14))
        .x_labels(x_label_count(x0, x1))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .bold_line_style(MESH)
        .light_line_style(TRANSPARENT)
        .draw()?;
    let guides = chart.draw_series(
        p.guides
            .iter()
            .map(|&g| PathElement::new(vec![(g, y.start), (g, y.end)], GUIDE.stroke_width(1))),
    )?;
    if let Some(note) = p.guide_note {
        guides.label(note).legend(|(x, y)| {
            PathElement::new(
                vec![(x + 10, y - 7), (x + 10, y + 7)],
                GUIDE.stroke_width(1),
            )
        });
    }
    for c in &p.curves {
        draw_curve(&mut chart, c)?;
    }
    if !p.finals.is_empty() {
        for f in &p.finals {
            if let Some(from) = f.from {
                chart.draw_series(DashedLineSeries::new(
                    vec![from, (f.x, f.y)],
                    6,
                    4,
                    f.color.stroke_width(1),
                ))?;
            }
            if f.high > f.low {
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![(f.x, f.low), (f.x, f.high)],
                    f.color.stroke_width(2),
                )))?;
            }
        }
        chart
            .draw_series(
                p.finals
                    .iter()
                    .map(|f| TriangleMarker::new((f.x, f.y), 9, f.color.filled())),
            )?
            .label("final held-out eval (last policy)")
            .legend(|(x, y)| TriangleMarker::new((x + 10, y), 7, BLACK.filled()));
    }
    if let Some(note) = p.band_note {
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())?
            .label(note)
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], BAND.filled()));
    }
    if p.is_empty() {
        let (xm, ym) = ((x0 + x1) / 2.0, (y.start + y.end) / 2.0);
        chart.draw_series(std::iter::once(Text::new(
            "no data: the rows do not record this",
            (xm, ym),
            (FONT_FAMILY, 18)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Center)),
        )))?;
    } else {
        chart
            .configure_series_labels()
            .position(p.legend.clone())
            .background_style(WHITE)
            .border_style(BLACK)
            .label_font((FONT_FAMILY, 15))
            .draw()?;
    }
    Ok(())
}

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn draw_curve(chart: &mut Chart, c: &Curve) -> Result<()> {
    if c.points.is_empty() {
        return Ok(());
    }
    let color = c.color;
    if c.band.len() > 1 && c.band.iter().any(|b| b.2 > b.1) {
        let upper = c.band.iter().map(|b| (b.0, b.2));
        let lower = c.band.iter().rev().map(|b| (b.0, b.1));
        chart.draw_series(std::iter::once(Polygon::new(
            upper.chain(lower).collect::<Vec<_>>(),
            color.mix(BAND_ALPHA).filled(),
        )))?;
    } else if let [(x, low, high)] = c.band[..] {
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(x, low), (x, high)],
            color.stroke_width(2),
        )))?;
    }
    let style = color.stroke_width(2);
    let drawn = if c.segments {
        chart.draw_series(
            c.points
                .chunks(2)
                .map(|pair| PathElement::new(pair.to_vec(), style)),
        )?
    } else {
        chart.draw_series(LineSeries::new(c.points.iter().copied(), style))?
    };
    drawn
        .label(&c.label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    if c.markers {
        chart.draw_series(c.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    Ok(())
}

/// The smallest and largest finite value; (0, 1) if none, widened to `min_width` around a
/// single value.
fn span(values: impl Iterator<Item = f64>, min_width: f64) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    if hi - lo < min_width.max(f64::EPSILON) {
        let half = min_width.max(if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 }) / 2.0;
        return (lo - half, hi + half);
    }
    (lo, hi)
}

/// How many x labels to ask for: no more than the whole numbers in the range (plotters
/// then picks steps of 1, 2, 5, 10, ...: iterations and optimizer steps are whole), at most
/// a dozen.
fn x_label_count(x0: f64, x1: f64) -> usize {
    ((x1 - x0).floor() as usize + 1).clamp(2, 12)
}

/// Registers the plots' font once per process: $TUTOR_PLOT_FONT if set, else the first of
/// FONT_PATHS that holds a font. plotters' `ab_glyph` text borrows the font's bytes for
/// the process's lifetime, hence the one leak.
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<PathBuf> = OnceLock::new();
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let from_env = std::env::var_os(FONT_ENV).filter(|p| !p.is_empty());
    let candidates: Vec<PathBuf> = match &from_env {
        Some(p) => vec![PathBuf::from(p)],
        None => FONT_PATHS.iter().map(PathBuf::from).collect(),
    };
    for path in &candidates {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if from_env.is_some() => {
                bail!(
                    "cannot read the plot font {} (${FONT_ENV}): {e}",
                    path.display()
                )
            }
            Err(_) => continue,
        };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        if plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, bytes).is_ok() {
            let _ = REGISTERED.set(path.clone());
            return Ok(());
        }
        if from_env.is_some() {
            bail!(
                "{} (${FONT_ENV}) is not a TrueType or OpenType font",
                path.display()
            );
        }
    }
    bail!(
        "no font to draw the plots' text with: tried {}. Install the package \
         fonts-dejavu-core (`make setup` does, or `apt-get install fonts-dejavu-core`), or \
         set {FONT_ENV} to a .ttf file",
        FONT_PATHS.join(", ")
    )
}

fn dir_name(dir: &Path) -> String {
    dir.canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_rows_leave_new_fields_absent() {
        let v = serde_json::json!({"iteration": 2, "train_loss": 0.5, "heldout_solve_rate": 0.25,
            "heldout_episodes": 8, "agreement_rate": 0.75});
        let p = IterationPoint::from_row(&v).unwrap();
        assert_eq!(p.solve_rate, Some(0.25));
        assert_eq!(p.disagreement, Some(0.25));
        assert_eq!(p.reverse_kl, None);
        assert!(p.step_losses.is_empty());
    }

    #[test]
    fn unmeasured_values_are_absent() {
        let v = serde_json::json!({"iteration": 0, "heldout_solve_rate": 0.0,
            "heldout_episodes": 0, "agreement_rate": 0.0, "disagreement_rate": 0.0,
            "step_losses": [1.0, 3.0]});
        let p = IterationPoint::from_row(&v).unwrap();
        assert_eq!(p.solve_rate, None);
        assert_eq!(p.disagreement, None);
        assert_eq!(p.train_loss, Some(2.0));
    }

    #[test]
    fn stats_use_the_sample_std() {
        let s = Stats::of(&[0.2, 0.4]).unwrap();
        assert!((s.mean - 0.3).abs() < 1e-12);
        assert!((s.std - 0.02f64.sqrt()).abs() < 1e-12);
        assert_eq!((s.min, s.max), (0.2, 0.4));
        assert_eq!(Stats::of(&[0.5]).unwrap().std, 0.0);
    }
}
