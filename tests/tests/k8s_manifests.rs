//! The Kubernetes manifests (deploy/k8s) checked without a cluster: each overlay rendered
//! as `kubectl apply -k` renders it, every object read into its Kubernetes API type with
//! nothing dropped, the references between objects resolved, and each overlay's run
//! config prepared into a run directory by `tutor prepare`, as the pods' init containers do.
//!
//! The renderer implements the subset of kustomize that deploy/k8s uses, and refuses any
//! other field of a kustomization.yaml, so that a manifest using more fails here until
//! the renderer learns it. `kubectl apply -k` accepts the same files, and where kubectl is
//! installed a test renders every overlay with it and compares, object by object. The
//! subset (where the renderer is stricter than kustomize, it says so):
//! - `resources`: YAML files in the kustomization's folder (several documents each) and
//!   folders holding a kustomization.yaml (rendered in full first);
//! - `configMapGenerator` and `secretGenerator`: `files` (`path` or `key=path`), `envs`
//!   (`KEY=VALUE` lines, `#` comments), `literals`, `type` (secrets), and `behavior`:
//!   `create` (the default), or `replace` / `merge` of the object a resource already made
//!   (its name, namespace, labels and annotations kept); `generatorOptions:
//!   {disableNameSuffixHash: true}` is required, so names carry no hash suffix and no
//!   reference is rewritten;
//! - `patches`: JSON 6902 only, `target: {kind, name}` (exact names, not regular
//!   expressions) and an inline `patch:`
//!   list of `add`, `remove`, `replace` and `test` operations; a target that matches
//!   nothing is an error here (kustomize skips it);
//! - `namespace`: set on every object but a Namespace, which is renamed to it;
//! - `labels`: `pairs` on every object's metadata, and with `includeTemplates: true` on pod
//!   templates and StatefulSets' volume claim templates too (`includeSelectors: true` is
//!   refused);
//! - `images`: `name`, `newName`, `newTag`, on pod templates' containers and init
//!   containers;
//!
//! applied in kustomize's order: resources, generators, patches, namespace, labels, images.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PersistentVolumeClaim, PodSpec, PodTemplateSpec, Secret,
    Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tutor_proto::episode_event::Event;

const OVERLAYS: [&str; 3] = ["cpu", "gpu", "engine"];
const NAMESPACE: &str = "tutor";
const PART_OF: (&str, &str) = ("app.kubernetes.io/part-of", "tutor");
const ROLE: &str = "app.kubernetes.io/name";
/// The uid the tutor image runs as.
const TUTOR_UID: i64 = 10001;

// ---------------------------------------------------------------------------------------
// The renderer.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    api_version: Option<String>,
    kind: Option<String>,
    namespace: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    labels: Vec<LabelSet>,
    generator_options: Option<GeneratorOptions>,
    #[serde(default)]
    config_map_generator: Vec<Generator>,
    #[serde(default)]
    secret_generator: Vec<Generator>,
    #[serde(default)]
    patches: Vec<Patch>,
    #[serde(default)]
    images: Vec<Image>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LabelSet {
    pairs: BTreeMap<String, String>,
    #[serde(default)]
    include_selectors: bool,
    #[serde(default)]
    include_templates: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GeneratorOptions {
    disable_name_suffix_hash: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Generator {
    name: String,
    behavior: Option<String>,
    #[serde(default)]
    files: Vec<String>,
    #[serde(default)]
    envs: Vec<String>,
    #[serde(default)]
    literals: Vec<String>,
    #[serde(rename = "type")]
    type_: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Patch {
    target: Target,
    patch: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    kind: String,
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Op {
    op: String,
    path: String,
    value: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Image {
    name: String,
    new_name: Option<String>,
    new_tag: Option<String>,
}

/// The objects `kubectl apply -k DIR` would send, in order.
fn render(dir: &Path) -> Result<Vec<Value>, String> {
    let path = dir.join("kustomization.yaml");
    let at = |e: String| format!("{}: {e}", path.display());
    let k: Kustomization = serde_norway::from_str(&read(&path)?).map_err(|e| at(e.to_string()))?;
    let api = k
        .api_version
        .as_deref()
        .unwrap_or("kustomize.config.k8s.io/v1beta1");
    if k.kind.as_deref().unwrap_or("Kustomization") != "Kustomization"
        || !api.starts_with("kustomize.config.k8s.io/")
    {
        return Err(at("not a Kustomization".into()));
    }
    let mut objects = Vec::new();
    for r in &k.resources {
        let p = dir.join(r);
        let found = if p.is_dir() {
            render(&p)?
        } else {
            read_yaml(&inside(dir, r)?)?
        };
        for o in found {
            if objects.iter().any(|x| id(x) == id(&o)) {
                return Err(at(format!("{} is defined twice", id(&o))));
            }
            objects.push(o);
        }
    }

    let generators = k.config_map_generator.iter().map(|g| ("ConfigMap", g));
    let generators: Vec<_> = generators
        .chain(k.secret_generator.iter().map(|g| ("Secret", g)))
        .collect();
    let hashless = k
        .generator_options
        .as_ref()
        .is_some_and(|o| o.disable_name_suffix_hash);
    if !generators.is_empty() && !hashless {
        return Err(at(
            "name suffix hashes are not rendered here; set generatorOptions: \
                       {disableNameSuffixHash: true}"
                .into(),
        ));
    }
    for (kind, g) in generators {
        let made = generate(dir, kind, g).map_err(at)?;
        let behavior = g.behavior.as_deref().unwrap_or("create");
        absorb(&mut objects, made, behavior).map_err(|e| at(format!("{kind} {}: {e}", g.name)))?;
    }
    for p in &k.patches {
        let what = format!("patch of {}/{}", p.target.kind, p.target.name);
        apply_patch(&mut objects, p).map_err(|e| at(format!("{what}: {e}")))?;
    }
    if let Some(ns) = &k.namespace {
        for o in &mut objects {
            let field = if o["kind"] == "Namespace" {
                "name"
            } else {
                "namespace"
            };
            o["metadata"][field] = json!(ns);
        }
    }
    for set in &k.labels {
        if set.include_selectors {
            return Err(at(
                "labels with includeSelectors are not rendered here".into()
            ));
        }
        objects.iter_mut().for_each(|o| label(o, set));
    }
    for image in &k.images {
        objects.iter_mut().for_each(|o| retag(o, image));
    }
    Ok(objects)
}

fn label(o: &mut Value, set: &LabelSet) {
    add_labels(&mut o["metadata"], &set.pairs);
    if set.include_templates && o["spec"]["template"].is_object() {
        add_labels(&mut o["spec"]["template"]["metadata"], &set.pairs);
        let claims = o.pointer_mut("/spec/volumeClaimTemplates");
        for claim in claims.and_then(Value::as_array_mut).into_iter().flatten() {
            add_labels(&mut claim["metadata"], &set.pairs);
        }
    }
}

fn add_labels(metadata: &mut Value, pairs: &BTreeMap<String, String>) {
    for (k, v) in pairs {
        metadata["labels"][k] = json!(v);
    }
}

/// The `images` transformer on a pod template's containers and init containers.
fn retag(o: &mut Value, image: &Image) {
    // (Indexing a Value mutably would create the path where it is missing.)
    let Some(spec) = o.pointer_mut("/spec/template/spec") else {
        return;
    };
    for list in ["containers", "initContainers"] {
        for c in spec
            .get_mut(list)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let Some((name, rest)) = c["image"].as_str().map(split_image) else {
                continue;
            };
            if name == image.name {
                let new_name = image.new_name.as_deref().unwrap_or(name);
                let tag = image.new_tag.as_ref().map(|t| format!(":{t}"));
                let new = format!("{new_name}{}", tag.as_deref().unwrap_or(rest));
                c["image"] = json!(new);
            }
        }
    }
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

/// A file a kustomization names: inside its folder, as kustomize's default load
/// restrictor demands (only kustomization folders may be elsewhere).
fn inside(dir: &Path, name: &str) -> Result<PathBuf, String> {
    if Path::new(name)
        .components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(format!(
            "{}: {name} is outside the kustomization's folder",
            dir.display()
        ));
    }
    Ok(dir.join(name))
}

fn read_yaml(path: &Path) -> Result<Vec<Value>, String> {
    let text = read(path)?;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).map_err(|e| format!("{}: {e}", path.display()))?;
        if v.is_null() {
            continue;
        }
        if !(v["kind"].is_string() && v["metadata"]["name"].is_string()) {
            return Err(format!(
                "{}: a document without kind or metadata.name",
                path.display()
            ));
        }
        docs.push(v);
    }
    Ok(docs)
}

/// `Kind/namespace/name`, kustomize's identity of an object.
fn id(o: &Value) -> String {
    let ns = o["metadata"]["namespace"].as_str().unwrap_or("");
    format!(
        "{}/{ns}/{}",
        o["kind"].as_str().unwrap_or(""),
        o["metadata"]["name"].as_str().unwrap_or("")
    )
}

fn generate(dir: &Path, kind: &str, g: &Generator) -> Result<Value, String> {
    let mut data = BTreeMap::new();
    for f in &g.files {
        let (key, file) = f.split_once('=').unwrap_or((f.as_str(), f.as_str()));
        let key = Path::new(key)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        data.insert(key, read(&inside(dir, file)?)?);
    }
    for f in &g.envs {
        for line in read(&inside(dir, f)?)?.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("{f}: {line:?} is not KEY=VALUE"))?;
            data.insert(k.to_string(), v.to_string());
        }
    }
    for l in &g.literals {
        let (k, v) = l
            .split_once('=')
            .ok_or_else(|| format!("literal {l:?} is not KEY=VALUE"))?;
        data.insert(k.to_string(), v.to_string());
    }
    let metadata = json!({ "name": g.name });
    Ok(match kind {
        "ConfigMap" => {
            json!({"apiVersion": "v1", "kind": kind, "metadata": metadata, "data": data})
        }
        _ => {
            let data: BTreeMap<String, ByteString> = data
                .into_iter()
                .map(|(k, v)| (k, ByteString(v.into_bytes())))
                .collect();
            json!({
                "apiVersion": "v1",
                "kind": kind,
                "metadata": metadata,
                "type": g.type_.as_deref().unwrap_or("Opaque"),
                "data": data,
            })
        }
    })
}

/// A generated object joins the others as `behavior` says.
fn absorb(objects: &mut Vec<Value>, mut made: Value, behavior: &str) -> Result<(), String> {
    let at = objects.iter().position(|o| id(o) == id(&made));
    match (behavior, at) {
        ("create", None) => objects.push(made),
        ("create", Some(_)) => return Err("exists; behavior must be merge or replace".into()),
        ("replace" | "merge", None) => {
            return Err(format!(
                "{} does not exist; cannot merge or replace",
                id(&made)
            ))
        }
        ("replace" | "merge", Some(i)) => {
            let old = &objects[i];
            for field in ["labels", "annotations"] {
                let mut merged = old["metadata"][field]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                if let Some(new) = made["metadata"][field].as_object() {
                    merged.extend(new.clone());
                }
                if !merged.is_empty() {
                    made["metadata"][field] = Value::Object(merged);
                }
            }
            if behavior == "merge" {
                let mut data = old["data"].as_object().cloned().unwrap_or_default();
                data.extend(made["data"].as_object().cloned().unwrap_or_default());
                made["data"] = Value::Object(data);
            }
            objects[i] = made;
        }
        (other, _) => return Err(format!("unknown behavior {other:?}")),
    }
    Ok(())
}

fn apply_patch(objects: &mut [Value], p: &Patch) -> Result<(), String> {
    let doc: Value = serde_norway::from_str(&p.patch).map_err(|e| e.to_string())?;
    if !doc.is_array() {
        return Err("only JSON 6902 patches (a list of operations) are rendered here".into());
    }
    let ops: Vec<Op> = serde_json::from_value(doc).map_err(|e| e.to_string())?;
    let mut matched = false;
    for o in objects.iter_mut() {
        if o["kind"] == p.target.kind.as_str() && o["metadata"]["name"] == p.target.name.as_str() {
            matched = true;
            for op in &ops {
                apply_op(o, op).map_err(|e| format!("{} {}: {e}", op.op, op.path))?;
            }
        }
    }
    if matched {
        Ok(())
    } else {
        Err("the target matches no object".into())
    }
}

fn apply_op(doc: &mut Value, op: &Op) -> Result<(), String> {
    let value = || op.value.clone().ok_or("no value");
    let (parent, last) = op.path.rsplit_once('/').ok_or("a path starts with /")?;
    let last = last.replace("~1", "/").replace("~0", "~");
    match op.op.as_str() {
        "test" => match doc.pointer(&op.path) {
            Some(v) if *v == value()? => Ok(()),
            found => Err(format!("expected {}, found {found:?}", value()?)),
        },
        "replace" => {
            let at = doc.pointer_mut(&op.path).ok_or("no such path")?;
            *at = value()?;
            Ok(())
        }
        "add" | "remove" => {
            let at = doc.pointer_mut(parent).ok_or("no such parent path")?;
            match (op.op.as_str(), at) {
                ("add", Value::Object(m)) => {
                    m.insert(last, value()?);
                }
                ("remove", Value::Object(m)) => {
                    m.remove(&last).ok_or("no such field")?;
                }
                ("add", Value::Array(a)) if last == "-" => a.push(value()?),
                (op, Value::Array(a)) => {
                    let i: usize = last.parse().map_err(|_| "not an array index")?;
                    match op {
                        "add" if i <= a.len() => a.insert(i, value()?),
                        "remove" if i < a.len() => {
                            a.remove(i);
                        }
                        _ => return Err("index out of range".into()),
                    }
                }
                _ => return Err("the parent is not an object or a list".into()),
            }
            Ok(())
        }
        other => Err(format!("operation {other:?} is not rendered here")),
    }
}

/// `registry/name:tag` or `name@digest` as (name, ":tag" or "@digest" or "").
fn split_image(image: &str) -> (&str, &str) {
    if let Some(at) = image.find('@') {
        return image.split_at(at);
    }
    let base = image.rfind('/').map_or(0, |i| i + 1);
    match image[base..].rfind(':') {
        Some(c) => image.split_at(base + c),
        None => (image, ""),
    }
}

// ---------------------------------------------------------------------------------------
// Reading the rendered objects into their API types.

#[derive(Default)]
struct Rendered {
    overlay: String,
    deployments: Vec<Deployment>,
    stateful_sets: Vec<StatefulSet>,
    services: Vec<Service>,
    config_maps: Vec<ConfigMap>,
    secrets: Vec<Secret>,
    claims: Vec<PersistentVolumeClaim>,
    budgets: Vec<PodDisruptionBudget>,
    network_policies: Vec<NetworkPolicy>,
    service_accounts: Vec<ServiceAccount>,
    namespaces: Vec<Namespace>,
}

impl Rendered {
    /// The keys of the ConfigMap or Secret `name`, if the render has it.
    fn keys(&self, kind: &str, name: &str) -> Option<BTreeSet<String>> {
        let keys =
            |data: Option<Vec<&String>>| data.unwrap_or_default().into_iter().cloned().collect();
        match kind {
            "ConfigMap" => {
                let c = self
                    .config_maps
                    .iter()
                    .find(|c| name_of(&c.metadata) == name)?;
                Some(keys(c.data.as_ref().map(|d| d.keys().collect())))
            }
            _ => {
                let s = self.secrets.iter().find(|s| name_of(&s.metadata) == name)?;
                Some(keys(s.data.as_ref().map(|d| d.keys().collect())))
            }
        }
    }
}

/// Problems found, each naming the overlay, the object (Kind/name) and the field.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn add(&mut self, what: &str, field: &str, why: impl std::fmt::Display) {
        self.0.push(format!("{what}: {field}: {why}"));
    }
}

fn read_typed(overlay: &str, objects: &[Value], p: &mut Problems) -> Rendered {
    let mut r = Rendered {
        overlay: overlay.into(),
        ..Rendered::default()
    };
    for o in objects {
        let kind = o["kind"].as_str().unwrap_or_default();
        let what = format!(
            "{overlay}: {kind}/{}",
            o["metadata"]["name"].as_str().unwrap_or_default()
        );
        match kind {
            "Deployment" => r.deployments.extend(typed(&what, o, p)),
            "StatefulSet" => r.stateful_sets.extend(typed(&what, o, p)),
            "Service" => r.services.extend(typed(&what, o, p)),
            "ConfigMap" => r.config_maps.extend(typed(&what, o, p)),
            "Secret" => r.secrets.extend(typed(&what, o, p)),
            "PersistentVolumeClaim" => r.claims.extend(typed(&what, o, p)),
            "PodDisruptionBudget" => r.budgets.extend(typed(&what, o, p)),
            "NetworkPolicy" => r.network_policies.extend(typed(&what, o, p)),
            "ServiceAccount" => r.service_accounts.extend(typed(&what, o, p)),
            "Namespace" => r.namespaces.extend(typed(&what, o, p)),
            _ => p.add(
                &what,
                "kind",
                "not a kind this test reads (add it to read_typed and check it)",
            ),
        }
    }
    r
}

/// The object as its API type (Kubernetes 1.33's, from k8s-openapi), and a problem for
/// every field the type does not have: its deserializer skips unknown fields, so a typo'd
/// field would vanish here without a word (as on an API server without strict field
/// validation); read back, it is missing.
fn typed<T: DeserializeOwned + Serialize>(what: &str, o: &Value, p: &mut Problems) -> Option<T> {
    let t: T = match serde_path_to_error::deserialize(o) {
        Ok(t) => t,
        Err(e) => {
            p.add(what, &e.path().to_string(), e.inner());
            return None;
        }
    };
    let back = serde_json::to_value(&t).expect("an API type serializes");
    dropped(what, o, &back, "", p);
    Some(t)
}

fn dropped(what: &str, written: &Value, read: &Value, path: &str, p: &mut Problems) {
    match (written, read) {
        (Value::Object(w), Value::Object(r)) => {
            for (k, v) in w {
                let at = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match r.get(k) {
                    _ if v.is_null() => {}
                    None => p.add(what, &at, "no such field in the API (a typo?)"),
                    Some(rv) => dropped(what, v, rv, &at, p),
                }
            }
        }
        (Value::Array(w), Value::Array(r)) if w.len() == r.len() => {
            for (i, (wv, rv)) in w.iter().zip(r).enumerate() {
                dropped(what, wv, rv, &format!("{path}[{i}]"), p);
            }
        }
        // A quantity written as a number reads back as its string.
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        (w, r) if w == r => {}
        (w, r) => p.add(what, path, format!("written as {w}, read back as {r}")),
    }
}

// ---------------------------------------------------------------------------------------
// The checks.

/// A pod-making object: a Deployment or a StatefulSet.
struct Workload<'a> {
    what: String,
    kind: &'static str,
    name: &'a str,
    replicas: i32,
    selector: &'a LabelSelector,
    template: &'a PodTemplateSpec,
    claim_templates: Vec<&'a str>,
    service_name: Option<&'a str>,
}

impl Workload<'_> {
    fn labels(&self) -> BTreeMap<String, String> {
        self.template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone())
            .unwrap_or_default()
    }

    fn role(&self) -> String {
        self.labels().get(ROLE).cloned().unwrap_or_default()
    }

    /// Containers, then init containers (sidecars included), with their field path.
    fn containers(&self) -> Vec<(String, &Container)> {
        let Some(spec) = &self.template.spec else {
            return Vec::new();
        };
        let main = spec.containers.iter().enumerate();
        let main = main.map(|(i, c)| (format!("spec.template.spec.containers[{i}]"), c));
        let init = spec.init_containers.iter().flatten().enumerate();
        let init = init.map(|(i, c)| (format!("spec.template.spec.initContainers[{i}]"), c));
        main.chain(init).collect()
    }

    /// The containers that keep running: the main ones and native sidecars.
    fn running(&self) -> Vec<(String, &Container)> {
        self.containers()
            .into_iter()
            .filter(|(path, c)| {
                !path.contains("initContainers") || c.restart_policy.as_deref() == Some("Always")
            })
            .collect()
    }

    fn container_named(&self, name: &str) -> Option<&Container> {
        self.containers()
            .into_iter()
            .map(|(_, c)| c)
            .find(|c| c.name == name)
    }
}

fn workloads(r: &Rendered) -> Vec<Workload<'_>> {
    let mut out = Vec::new();
    for d in &r.deployments {
        let spec = d.spec.as_ref().expect("a Deployment has a spec");
        out.push(Workload {
            what: format!("{}: Deployment/{}", r.overlay, name_of(&d.metadata)),
            kind: "Deployment",
            name: name_of(&d.metadata),
            replicas: spec.replicas.unwrap_or(1),
            selector: &spec.selector,
            template: &spec.template,
            claim_templates: Vec::new(),
            service_name: None,
        });
    }
    for s in &r.stateful_sets {
        let spec = s.spec.as_ref().expect("a StatefulSet has a spec");
        out.push(Workload {
            what: format!("{}: StatefulSet/{}", r.overlay, name_of(&s.metadata)),
            kind: "StatefulSet",
            name: name_of(&s.metadata),
            replicas: spec.replicas.unwrap_or(1),
            selector: &spec.selector,
            template: &spec.template,
            claim_templates: spec
                .volume_claim_templates
                .iter()
                .flatten()
                .map(|c| name_of(&c.metadata))
                .collect(),
            service_name: spec.service_name.as_deref(),
        });
    }
    out
}

fn name_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    m.name.as_deref().unwrap_or("")
}

/// matchLabels of a selector; matchExpressions are not evaluated here.
fn match_labels(
    s: &LabelSelector,
    what: &str,
    field: &str,
    p: &mut Problems,
) -> BTreeMap<String, String> {
    if s.match_expressions.as_ref().is_some_and(|e| !e.is_empty()) {
        p.add(
            what,
            field,
            "matchExpressions are not checked here; use matchLabels",
        );
    }
    s.match_labels.clone().unwrap_or_default()
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Runs every check on one rendered overlay.
fn check(r: &Rendered, p: &mut Problems) {
    let ws = workloads(r);
    check_workloads(r, &ws, p);
    check_services(r, &ws, p);
    check_policies(r, &ws, p);
    for w in &ws {
        PodCheck { r, w, p }.run();
        check_containers(w, p);
    }
    check_addresses(r, &ws, p);
    check_run_config(r, &ws, p);
}

/// Every object in the namespace, labelled as part of the run.
fn check_metadata(overlay: &str, objects: &[Value], p: &mut Problems) {
    for o in objects {
        let m = &o["metadata"];
        let what = format!(
            "{overlay}: {}/{}",
            o["kind"].as_str().unwrap_or(""),
            m["name"]
        );
        let ns = if o["kind"] == "Namespace" {
            &m["name"]
        } else {
            &m["namespace"]
        };
        if ns != NAMESPACE {
            p.add(
                &what,
                "metadata.namespace",
                format!("{ns}, not {NAMESPACE}"),
            );
        }
        if m["labels"][PART_OF.0] != PART_OF.1 {
            p.add(
                &what,
                "metadata.labels",
                format!("no {}={}", PART_OF.0, PART_OF.1),
            );
        }
    }
}

/// Selectors select their own pods, which carry the run's and their role's labels; a
/// StatefulSet's serviceName is a headless Service in front of them.
fn check_workloads(r: &Rendered, ws: &[Workload], p: &mut Problems) {
    for w in ws {
        let labels = w.labels();
        let sel = match_labels(w.selector, &w.what, "spec.selector", p);
        let mut fail = |field: &str, why: String| p.add(&w.what, field, why);
        if sel.is_empty() || !selects(&sel, &labels) {
            fail(
                "spec.selector",
                format!("{sel:?} does not select the template's {labels:?}"),
            );
        }
        if labels.get(PART_OF.0).map(String::as_str) != Some(PART_OF.1) || w.role().is_empty() {
            fail(
                "spec.template.metadata.labels",
                format!("needs {} and {ROLE}", PART_OF.0),
            );
        }
        if w.kind != "StatefulSet" {
            continue;
        }
        let name = w.service_name.unwrap_or_default();
        let service = r.services.iter().find(|s| name_of(&s.metadata) == name);
        let spec = service.map(|s| s.spec.clone().unwrap_or_default());
        match spec {
            None => fail("spec.serviceName", format!("no Service {name:?}")),
            Some(spec) if spec.cluster_ip.as_deref() != Some("None") => fail(
                "spec.serviceName",
                format!("Service {name} is not headless"),
            ),
            Some(spec) if !selects(&spec.selector.clone().unwrap_or_default(), &labels) => fail(
                "spec.serviceName",
                format!("Service {name} does not select these pods"),
            ),
            Some(_) => {}
        }
    }
}

/// Every Service selects some workload's pods, and each target port is one of theirs.
fn check_services(r: &Rendered, ws: &[Workload], p: &mut Problems) {
    for s in &r.services {
        let what = format!("{}: Service/{}", r.overlay, name_of(&s.metadata));
        let spec = s.spec.clone().unwrap_or_default();
        let sel = spec.selector.clone().unwrap_or_default();
        let selected: Vec<&Workload> = ws
            .iter()
            .filter(|w| !sel.is_empty() && selects(&sel, &w.labels()))
            .collect();
        if selected.is_empty() {
            p.add(
                &what,
                "spec.selector",
                format!("{sel:?} selects no workload's pods"),
            );
            continue;
        }
        let ports = spec.ports.clone().unwrap_or_default();
        if ports.is_empty() && spec.cluster_ip.as_deref() != Some("None") {
            p.add(&what, "spec.ports", "none, and the Service is not headless");
        }
        for (i, port) in ports.iter().enumerate() {
            let target = port
                .target_port
                .clone()
                .unwrap_or(IntOrString::Int(port.port));
            for w in &selected {
                if !has_port(w, &target) {
                    p.add(
                        &what,
                        &format!("spec.ports[{i}].targetPort"),
                        format!("{} is not a container port of {}", show(&target), w.what),
                    );
                }
            }
        }
    }
}

fn has_port(w: &Workload, target: &IntOrString) -> bool {
    w.running().iter().any(|(_, c)| {
        c.ports.iter().flatten().any(|cp| match target {
            IntOrString::Int(n) => cp.container_port == *n,
            IntOrString::String(name) => cp.name.as_deref() == Some(name.as_str()),
        })
    })
}

fn show(port: &IntOrString) -> String {
    match port {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) => format!("{s:?}"),
    }
}

/// Disruption budgets and network policies select pods that exist, on ports they have.
fn check_policies(r: &Rendered, ws: &[Workload], p: &mut Problems) {
    let matching = |sel: &BTreeMap<String, String>| -> Vec<&Workload> {
        ws.iter().filter(|w| selects(sel, &w.labels())).collect()
    };
    for b in &r.budgets {
        let what = format!(
            "{}: PodDisruptionBudget/{}",
            r.overlay,
            name_of(&b.metadata)
        );
        let spec = b.spec.clone().unwrap_or_default();
        let sel = spec
            .selector
            .map(|s| match_labels(&s, &what, "spec.selector", p))
            .unwrap_or_default();
        if sel.is_empty() || matching(&sel).is_empty() {
            p.add(
                &what,
                "spec.selector",
                format!("{sel:?} selects no workload's pods"),
            );
        }
        if spec.min_available.is_none() == spec.max_unavailable.is_none() {
            p.add(
                &what,
                "spec",
                "give exactly one of minAvailable and maxUnavailable",
            );
        }
    }
    for n in &r.network_policies {
        let what = format!("{}: NetworkPolicy/{}", r.overlay, name_of(&n.metadata));
        let spec = n.spec.clone().unwrap_or_default();
        let pods = spec.pod_selector.unwrap_or_default();
        let sel = match_labels(&pods, &what, "spec.podSelector", p);
        let targets = matching(&sel);
        if sel.is_empty() || targets.is_empty() {
            p.add(
                &what,
                "spec.podSelector",
                format!("{sel:?} selects no workload's pods"),
            );
        }
        for (i, rule) in spec.ingress.iter().flatten().enumerate() {
            for (j, peer) in rule.from.iter().flatten().enumerate() {
                let field = format!("spec.ingress[{i}].from[{j}].podSelector");
                match (&peer.pod_selector, &peer.namespace_selector) {
                    (Some(ps), None) => {
                        let sel = match_labels(ps, &what, &field, p);
                        if matching(&sel).is_empty() {
                            p.add(&what, &field, format!("{sel:?} selects no workload's pods"));
                        }
                    }
                    (None, Some(ns)) => {
                        let field = format!("spec.ingress[{i}].from[{j}].namespaceSelector");
                        if match_labels(ns, &what, &field, p).is_empty() {
                            p.add(&what, &field, "empty: every namespace");
                        }
                    }
                    _ => {}
                }
            }
            for (j, port) in rule.ports.iter().flatten().enumerate() {
                let Some(port) = &port.port else { continue };
                for w in &targets {
                    if !has_port(w, port) {
                        p.add(
                            &what,
                            &format!("spec.ingress[{i}].ports[{j}].port"),
                            format!("{} is not a container port of {}", show(port), w.what),
                        );
                    }
                }
            }
        }
    }
}

/// One workload's pods: volumes, mounts, env and envFrom name objects and keys that
/// exist; `$(VAR)` references are defined. Each problem names the workload.
struct PodCheck<'a> {
    r: &'a Rendered,
    w: &'a Workload<'a>,
    p: &'a mut Problems,
}

impl PodCheck<'_> {
    fn fail(&mut self, field: &str, why: impl std::fmt::Display) {
        self.p.add(&self.w.what, field, why);
    }

    /// A reference to the ConfigMap or Secret `name`, and to its `key` if given.
    fn data_ref(&mut self, field: &str, kind: &str, name: &str, key: Option<&str>) {
        match (self.r.keys(kind, name), key) {
            (None, _) => self.fail(field, format!("no {kind} {name}")),
            (Some(keys), Some(key)) if !keys.contains(key) => self.fail(
                field,
                format!("{kind} {name} has no key {key:?} (it has {keys:?})"),
            ),
            _ => {}
        }
    }

    fn run(&mut self) {
        let Some(spec) = &self.w.template.spec else {
            return self.fail("spec.template.spec", "missing");
        };
        if let Some(sa) = spec.service_account_name.as_deref() {
            if sa != "default"
                && !self
                    .r
                    .service_accounts
                    .iter()
                    .any(|s| name_of(&s.metadata) == sa)
            {
                self.fail(
                    "spec.template.spec.serviceAccountName",
                    format!("no ServiceAccount {sa}"),
                );
            }
        }
        let volumes = self.volumes(spec);
        let mut mounted = BTreeSet::new();
        for (path, c) in self.w.containers() {
            for (i, m) in c.volume_mounts.iter().flatten().enumerate() {
                let field = format!("{path}.volumeMounts[{i}]");
                mounted.insert(m.name.clone());
                match (volumes.get(&m.name), &m.sub_path) {
                    (None, _) => {
                        self.fail(&format!("{field}.name"), format!("no volume {}", m.name))
                    }
                    (Some(Some(paths)), Some(sub)) if !paths.contains(sub) => self.fail(
                        &format!("{field}.subPath"),
                        format!("volume {} has no {sub:?}", m.name),
                    ),
                    _ => {}
                }
            }
            self.env(&path, c);
        }
        for name in volumes.keys().filter(|v| !mounted.contains(*v)) {
            self.fail(
                "spec.template.spec.volumes",
                format!("{name} is mounted by no container"),
            );
        }
    }

    /// The pod's volumes (and volume claim templates), each with the paths a subPath may
    /// name in it (None: any).
    fn volumes(&mut self, spec: &PodSpec) -> BTreeMap<String, Option<BTreeSet<String>>> {
        let mut volumes = BTreeMap::new();
        for (i, v) in spec.volumes.iter().flatten().enumerate() {
            let field = format!("spec.template.spec.volumes[{i}]");
            let data = match (&v.config_map, &v.secret) {
                (Some(c), _) => Some(("ConfigMap", "configMap", c.name.clone(), &c.items)),
                (_, Some(s)) => Some((
                    "Secret",
                    "secret",
                    s.secret_name.clone().unwrap_or_default(),
                    &s.items,
                )),
                _ => None,
            };
            let mut paths = None;
            if let Some((kind, source, name, items)) = data {
                for (j, item) in items.iter().flatten().enumerate() {
                    let at = format!("{field}.{source}.items[{j}].key");
                    self.data_ref(&at, kind, &name, Some(&item.key));
                }
                if items.is_none() {
                    self.data_ref(&format!("{field}.{source}"), kind, &name, None);
                }
                paths = Some(match items {
                    Some(items) => items.iter().map(|i| i.path.clone()).collect(),
                    None => self.r.keys(kind, &name).unwrap_or_default(),
                });
            }
            if let Some(c) = &v.persistent_volume_claim {
                if !self
                    .r
                    .claims
                    .iter()
                    .any(|pvc| name_of(&pvc.metadata) == c.claim_name)
                {
                    let why = format!("no PersistentVolumeClaim {}", c.claim_name);
                    self.fail(&format!("{field}.persistentVolumeClaim.claimName"), why);
                }
            }
            if volumes.insert(v.name.clone(), paths).is_some() {
                self.fail(&field, format!("a second volume named {}", v.name));
            }
        }
        for c in &self.w.claim_templates {
            volumes.insert(c.to_string(), None);
        }
        volumes
    }

    fn env(&mut self, path: &str, c: &Container) {
        for (i, e) in c.env_from.iter().flatten().enumerate() {
            let field = format!("{path}.envFrom[{i}]");
            if let Some(cm) = e
                .config_map_ref
                .as_ref()
                .filter(|r| r.optional != Some(true))
            {
                self.data_ref(&field, "ConfigMap", &cm.name, None);
            }
            if let Some(s) = e.secret_ref.as_ref().filter(|r| r.optional != Some(true)) {
                self.data_ref(&field, "Secret", &s.name, None);
            }
        }
        let mut defined = BTreeSet::new();
        for (i, e) in c.env.iter().flatten().enumerate() {
            let field = format!("{path}.env[{i}]");
            for var in references(e.value.as_deref().unwrap_or("")) {
                if !defined.contains(var) {
                    self.fail(
                        &format!("{field}.value"),
                        format!("$({var}) is not defined above it"),
                    );
                }
            }
            defined.insert(e.name.as_str());
            let Some(from) = &e.value_from else { continue };
            if let Some(k) = from
                .config_map_key_ref
                .as_ref()
                .filter(|k| k.optional != Some(true))
            {
                let at = format!("{field}.valueFrom.configMapKeyRef");
                self.data_ref(&at, "ConfigMap", &k.name, Some(&k.key));
            }
            if let Some(k) = from
                .secret_key_ref
                .as_ref()
                .filter(|k| k.optional != Some(true))
            {
                let at = format!("{field}.valueFrom.secretKeyRef");
                self.data_ref(&at, "Secret", &k.name, Some(&k.key));
            }
            if let Some(f) = &from.field_ref {
                let at = format!("{field}.valueFrom.fieldRef.fieldPath");
                if let Err(why) = field_ref(self.w, &f.field_path) {
                    self.fail(&at, why);
                }
            }
        }
        for (list, args) in [("command", &c.command), ("args", &c.args)] {
            for (i, a) in args.iter().flatten().enumerate() {
                for var in references(a).into_iter().filter(|v| !defined.contains(v)) {
                    self.fail(
                        &format!("{path}.{list}[{i}]"),
                        format!("$({var}) is not in the container's env"),
                    );
                }
            }
        }
    }
}

/// The `$(NAME)` references Kubernetes expands in env values, commands and args (an
/// undefined one is left as it is, silently).
fn references(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("$(") {
        let after = &rest[start + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(&after[..end]);
        rest = &after[end + 1..];
    }
    out
}

/// A downward-API field these pods have.
fn field_ref(w: &Workload, path: &str) -> Result<(), String> {
    const PLAIN: [&str; 8] = [
        "metadata.name",
        "metadata.namespace",
        "metadata.uid",
        "spec.nodeName",
        "spec.serviceAccountName",
        "status.hostIP",
        "status.podIP",
        "status.podIPs",
    ];
    let label = path
        .strip_prefix("metadata.labels['")
        .and_then(|l| l.strip_suffix("']"));
    match label {
        _ if PLAIN.contains(&path) => Ok(()),
        // Set by the StatefulSet controller on each pod.
        Some("apps.kubernetes.io/pod-index" | "statefulset.kubernetes.io/pod-name")
            if w.kind == "StatefulSet" =>
        {
            Ok(())
        }
        Some(l) if w.labels().contains_key(l) => Ok(()),
        _ => Err(format!("{path:?} is no field or label these pods have")),
    }
}

/// Requests and limits on every container; the security context by container kind;
/// probes on the container's own ports.
fn check_containers(w: &Workload, p: &mut Problems) {
    for (path, c) in w.containers() {
        let mut fail = |field: &str, why: String| p.add(&w.what, &format!("{path}.{field}"), why);
        let res = c.resources.clone().unwrap_or_default();
        let (requests, limits) = (
            res.requests.unwrap_or_default(),
            res.limits.unwrap_or_default(),
        );
        for (which, map) in [("requests", &requests), ("limits", &limits)] {
            for resource in ["cpu", "memory"] {
                match map.get(resource).map(|q| quantity(&q.0)) {
                    None => fail(&format!("resources.{which}.{resource}"), "missing".into()),
                    Some(None) => fail(
                        &format!("resources.{which}.{resource}"),
                        "not a quantity".into(),
                    ),
                    Some(Some(_)) => {}
                }
            }
        }
        for (resource, request) in &requests {
            let limit = limits.get(resource).and_then(|q| quantity(&q.0));
            if quantity(&request.0)
                .zip(limit)
                .is_some_and(|(req, lim)| req > lim)
            {
                fail(
                    &format!("resources.requests.{resource}"),
                    "above its limit".into(),
                );
            }
        }

        let sc = c.security_context.clone().unwrap_or_default();
        if is_tutor(c) {
            if sc.run_as_non_root != Some(true) || sc.run_as_user != Some(TUTOR_UID) {
                let why =
                    format!("needs runAsNonRoot true and runAsUser {TUTOR_UID} (the image's user)");
                fail("securityContext", why);
            }
            if sc.allow_privilege_escalation != Some(false) {
                fail(
                    "securityContext.allowPrivilegeEscalation",
                    "must be false".into(),
                );
            }
        }
        if sc.privileged == Some(true) && !is_dind(c) {
            fail(
                "securityContext.privileged",
                "only the Docker engine sidecar is privileged".into(),
            );
        }

        let own: BTreeSet<i32> = c
            .ports
            .iter()
            .flatten()
            .map(|cp| cp.container_port)
            .collect();
        let probes = [
            ("startupProbe", &c.startup_probe),
            ("readinessProbe", &c.readiness_probe),
            ("livenessProbe", &c.liveness_probe),
        ];
        for (which, probe) in probes {
            let Some(probe) = probe else { continue };
            let grpc = probe.grpc.as_ref().map(|g| IntOrString::Int(g.port));
            let http = probe.http_get.as_ref().map(|h| h.port.clone());
            for (kind, port) in [("grpc", grpc), ("httpGet", http)] {
                let Some(port) = port else { continue };
                let theirs = match &port {
                    IntOrString::Int(n) => own.contains(n),
                    IntOrString::String(name) => {
                        let mut named = c.ports.iter().flatten();
                        named.any(|cp| cp.name.as_deref() == Some(name.as_str()))
                    }
                };
                if !theirs {
                    fail(
                        &format!("{which}.{kind}.port"),
                        format!("{} is not a port of this container", show(&port)),
                    );
                }
            }
        }
    }
}

/// A container of the tutor image (any registry), or one that runs the tutor binary.
fn is_tutor(c: &Container) -> bool {
    let image = c.image.as_deref().map(|i| split_image(i).0);
    image.is_some_and(|i| i.rsplit('/').next() == Some("tutor"))
        || c.command.as_deref() == Some(&["/usr/local/bin/tutor".to_string()][..])
}

fn is_dind(c: &Container) -> bool {
    let image = c.image.as_deref().unwrap_or("");
    image.starts_with("docker:") && image.ends_with("-dind")
}

/// A Kubernetes quantity in base units (cores, bytes).
fn quantity(q: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 11] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
    ];
    for (s, mult) in SUFFIXES {
        if let Some(n) = q.strip_suffix(s) {
            return n.parse::<f64>().ok().map(|n| n * mult);
        }
    }
    q.parse().ok()
}

/// Every `http://HOST:PORT` in a container's args and env is a Service of the render on
/// one of its ports; `POD.SERVICE` a StatefulSet pod that exists behind a headless one.
fn check_addresses(r: &Rendered, ws: &[Workload], p: &mut Problems) {
    for w in ws {
        for (path, c) in w.containers() {
            let args = c
                .args
                .iter()
                .flatten()
                .enumerate()
                .map(|(i, a)| (format!("{path}.args[{i}]"), a.clone()));
            let env =
                c.env.iter().flatten().enumerate().filter_map(|(i, e)| {
                    Some((format!("{path}.env[{i}].value"), e.value.clone()?))
                });
            for (field, value) in args.chain(env) {
                let Some(addr) = value
                    .strip_prefix("http://")
                    .or(value.strip_prefix("https://"))
                else {
                    continue;
                };
                let addr = addr.split('/').next().unwrap_or(addr);
                if let Err(e) = resolve(r, ws, addr) {
                    p.add(&w.what, &field, format!("{value}: {e}"));
                }
            }
        }
    }
}

fn resolve(r: &Rendered, ws: &[Workload], addr: &str) -> Result<(), String> {
    let (host, port) = addr.rsplit_once(':').ok_or("no port")?;
    let port: i32 = port.parse().map_err(|_| "not a port number")?;
    let labels: Vec<&str> = host.split('.').collect();
    let (pod, service) = match labels[..] {
        [service] => (None, service),
        [pod, service] => (Some(pod), service),
        _ => return Err("not SERVICE or POD.SERVICE (in this namespace)".into()),
    };
    let svc = r
        .services
        .iter()
        .find(|s| name_of(&s.metadata) == service)
        .ok_or(format!("no Service {service}"))?;
    let spec = svc.spec.clone().unwrap_or_default();
    if !spec.ports.iter().flatten().any(|sp| sp.port == port) {
        return Err(format!("Service {service} has no port {port}"));
    }
    if let Some(pod) = pod {
        if spec.cluster_ip.as_deref() != Some("None") {
            return Err(format!(
                "Service {service} is not headless: no per-pod names"
            ));
        }
        let found = ws.iter().any(|w| {
            w.service_name == Some(service)
                && pod
                    .strip_prefix(w.name)
                    .and_then(|i| i.strip_prefix('-'))
                    .and_then(|i| i.parse::<i32>().ok())
                    .is_some_and(|i| i < w.replicas)
        });
        if !found {
            return Err(format!("no StatefulSet behind {service} has a pod {pod}"));
        }
    }
    Ok(())
}

/// The run config's values, with the defaults of tutor/src/config.rs where unset.
struct RunToml(toml::Table);

impl RunToml {
    fn get(&self, section: &str, field: &str) -> Option<&toml::Value> {
        self.0.get(section).and_then(|s| s.get(field))
    }

    fn text(&self, section: &str, field: &str, default: &str) -> String {
        let v = self.get(section, field).and_then(toml::Value::as_str);
        v.unwrap_or(default).to_string()
    }

    fn number(&self, section: &str, field: &str, default: f64) -> f64 {
        let v = self.get(section, field);
        v.and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)))
            .unwrap_or(default)
    }
}

/// The run config every pod reads parses, asks for Docker sandboxes, and agrees with the
/// manifests: learner ranks, collective, GPUs, the Docker engine's room for episodes.
fn check_run_config(r: &Rendered, ws: &[Workload], p: &mut Problems) {
    let what = format!("{}: ConfigMap/tutor-config", r.overlay);
    let cm = r
        .config_maps
        .iter()
        .find(|c| name_of(&c.metadata) == "tutor-config");
    let Some(text) = cm.and_then(|c| c.data.as_ref()?.get("config.toml")) else {
        return p.add(&what, "data.config.toml", "missing");
    };
    let config = match toml::from_str(text) {
        Ok(c) => RunToml(c),
        Err(e) => return p.add(&what, "data.config.toml", e),
    };
    if !config.0.contains_key("run") {
        p.add(&what, "data.config.toml", "no [run] section");
    }
    if config.text("worker", "sandbox", "local") != "docker" {
        let why = "[worker] sandbox must be \"docker\": pods run episodes in the engine sidecar";
        p.add(&what, "data.config.toml", why);
    }
    for role in ["coordinator", "learner", "worker"] {
        let Some(w) = ws.iter().find(|w| w.role() == role) else {
            p.add(
                &what,
                "data.config.toml",
                format!("no workload with the {role} role"),
            );
            continue;
        };
        let mut fail = |field: String, why: String| p.add(&w.what, &field, why);
        let container = |name: &str| w.containers().into_iter().find(|(_, c)| c.name == name);
        match role {
            "coordinator" => {
                let spec = w.template.spec.as_ref();
                let grace = spec
                    .and_then(|s| s.termination_grace_period_seconds)
                    .unwrap_or(30);
                let shutdown = config.number("coordinator", "shutdown_grace_s", 30.0);
                if grace as f64 <= shutdown {
                    let why = format!(
                        "{grace} s, not above [coordinator] shutdown_grace_s ({shutdown} s)"
                    );
                    fail(
                        "spec.template.spec.terminationGracePeriodSeconds".into(),
                        why,
                    );
                }
                if w.kind != "Deployment" || w.replicas != 1 {
                    fail(
                        "spec.replicas".into(),
                        "one coordinator Deployment per run".into(),
                    );
                }
            }
            "learner" => match container("learner") {
                Some((path, c)) => check_learner(w, &path, c, &config, &mut fail),
                None => fail(
                    "spec.template.spec.containers".into(),
                    "no container learner".into(),
                ),
            },
            _ => match (container("worker"), container("docker")) {
                (Some(worker), Some(engine)) => check_worker(worker, engine, &config, &mut fail),
                _ => fail(
                    "spec.template.spec".into(),
                    "no containers worker and docker".into(),
                ),
            },
        }
    }
    check_student_engine(r, ws, &config, p);
}

/// `[worker.student] kind = "engine"`: the workers' `base_url` is a Service of the render;
/// when `tutor serve` runs behind it, it takes what the config sends (`reload`), holds
/// every worker's turns in one batch, and requires the key the workers (and a learner
/// that loads it) send; the NetworkPolicies let the workers and that learner reach it,
/// and with `loaded_by = "learner"` let it dial the learner's `engine_group_address`.
fn check_student_engine(r: &Rendered, ws: &[Workload], config: &RunToml, p: &mut Problems) {
    let what = format!("{}: ConfigMap/tutor-config", r.overlay);
    let student = config.0.get("worker").and_then(|w| w.get("student"));
    let field = |name: &str, default: &str| {
        let v = student
            .and_then(|s| s.get(name))
            .and_then(toml::Value::as_str);
        v.unwrap_or(default).to_string()
    };
    if field("kind", "local") != "engine" {
        return;
    }
    let mut fail = |why: String| p.add(&what, "data.config.toml", why);
    let base_url = field("base_url", "");
    let behind = match behind_url(r, ws, &base_url) {
        Ok(behind) => behind,
        Err(e) => return fail(format!("[worker.student] base_url {base_url:?}: {e}")),
    };
    let [(engine, engine_port)] = behind[..] else {
        return fail(format!(
            "[worker.student] base_url {base_url:?}: its Service must select one workload's \
             pods, found {}",
            behind.len()
        ));
    };
    let engine_name = format!("{}/{}", engine.kind, engine.name);
    if engine.replicas != 1 {
        // The learner loads the engine behind each url once: a second pod behind the same
        // Service would get only some of the versions.
        fail(format!(
            "{} has {} replicas behind {base_url:?}: one engine per Service",
            engine_name, engine.replicas
        ));
    }
    let learner_loads = field("loaded_by", "worker") == "learner";
    let role = |name: &str| ws.iter().find(|w| w.role() == name);
    let mut clients = vec![("worker", role("worker"))];
    if learner_loads {
        clients.push(("learner", role("learner")));
    }
    for (name, client) in &clients {
        match client {
            Some(c) if !admits(r, c, engine, engine_port) => fail(format!(
                "no NetworkPolicy lets the {name}'s pods reach {} on port {engine_port}",
                engine_name
            )),
            _ => {}
        }
    }
    let serve = engine
        .running()
        .into_iter()
        .find(|(_, c)| is_tutor(c) && c.args.iter().flatten().any(|a| a == "serve"));
    // Another server (vLLM, SGLang) is configured by its own flags.
    let Some((path, serve)) = serve else { return };
    let args: Vec<&str> = serve.args.iter().flatten().map(String::as_str).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| *a == name)
            .and_then(|i| args.get(i + 1))
    };
    let needed = match field("reload", "disk").as_str() {
        "distributed" => "--distributed-updates",
        _ => "--weights-root",
    };
    if !args.contains(&needed) {
        fail(format!(
            "[worker.student] reload = {:?}, but {} {path} has no {needed}",
            field("reload", "disk"),
            engine_name
        ));
    }
    let batch: f64 = flag("--max-batch")
        .and_then(|b| b.parse().ok())
        .unwrap_or(8.0);
    let workers = role("worker").map_or(0, |w| w.replicas);
    let capacity = config.number("worker", "capacity", 1.0);
    if batch < f64::from(workers) * capacity {
        fail(format!(
            "{} {path}: --max-batch {batch} holds fewer turns than {workers} workers x \
             [worker] capacity {capacity}",
            engine_name
        ));
    }
    // The key the engine requires is the one its clients send (compared when both come
    // from Secret keys in env; a key file mounted from a Secret is taken as given).
    let key_env = field("api_key_env", "TUTOR_STUDENT_API_KEY");
    let required = secret_env(serve, "TUTOR_SERVE_API_KEY");
    let key_file = args.contains(&"--api-key-file");
    if required.is_none() && !key_file && !args.contains(&"--insecure") {
        fail(format!(
            "{} {path}: no TUTOR_SERVE_API_KEY from a Secret nor --api-key-file (tutor \
             serve refuses a non-loopback --host without a key)",
            engine_name
        ));
    }
    for (name, client) in &clients {
        let sent = client
            .and_then(|w| w.container_named(name))
            .and_then(|c| secret_env(c, &key_env));
        if required.is_some() && sent != required {
            fail(format!(
                "the {name} sends {key_env} from {sent:?}, the engine requires {required:?}"
            ));
        }
    }
    if !learner_loads {
        return;
    }
    // The learner listens for the engine to join each version's weight-update group.
    let Some(learner) = role("learner") else {
        return;
    };
    let learner_name = format!("{}/{}", learner.kind, learner.name);
    let listen = config.text("learner", "engine_group_listen", "127.0.0.1:0");
    let group_port: i32 = listen
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_default();
    let group_host = config.text("learner", "engine_group_address", "");
    // Port 0 (several engines: a port each, picked at run time): the address names a pod
    // behind a Service, on whatever port that Service has.
    let address_port = match group_port {
        0 => r
            .services
            .iter()
            .find(|s| Some(name_of(&s.metadata)) == group_host.split('.').nth(1))
            .and_then(|s| s.spec.as_ref()?.ports.as_ref()?.first().map(|p| p.port))
            .unwrap_or_default(),
        port => port,
    };
    if let Err(e) = resolve(r, ws, &format!("{group_host}:{address_port}")) {
        fail(format!(
            "[learner] engine_group_address {group_host:?}: {e}"
        ));
    }
    if group_port != 0 && !has_port(learner, &IntOrString::Int(group_port)) {
        fail(format!(
            "[learner] engine_group_listen port {group_port} is not a container port of {}",
            learner_name
        ));
    }
    if !admits(r, engine, learner, group_port) {
        let port = match group_port {
            0 => "any port (engine_group_listen port 0)".to_string(),
            port => format!("port {port}"),
        };
        fail(format!(
            "no NetworkPolicy lets the engine's pods reach {learner_name} on {port} \
             ([learner] engine_group_listen)"
        ));
    }
    // Every engine the learner loads is one of this render's Services, which lets it in.
    let engines = config
        .get("learner", "engines")
        .and_then(toml::Value::as_array);
    for url in engines
        .into_iter()
        .flatten()
        .filter_map(toml::Value::as_str)
    {
        match behind_url(r, ws, url) {
            Err(e) => fail(format!("[learner] engines: {url:?}: {e}")),
            Ok(behind) => {
                for (w, port) in behind {
                    if !admits(r, learner, w, port) {
                        fail(format!(
                            "[learner] engines: {url:?}: the learner's pods cannot reach {}/{}",
                            w.kind, w.name
                        ));
                    }
                }
            }
        }
    }
}

/// The workloads behind `url` (`http://SERVICE:PORT`, a Service of the render), each with
/// the container port the Service's port leads to on its pods.
fn behind_url<'a>(
    r: &Rendered,
    ws: &'a [Workload<'a>],
    url: &str,
) -> Result<Vec<(&'a Workload<'a>, i32)>, String> {
    let addr = url
        .strip_prefix("http://")
        .unwrap_or(url)
        .trim_end_matches('/');
    resolve(r, ws, addr)?;
    let (host, port) = addr.rsplit_once(':').unwrap_or_default();
    let port: i32 = port.parse().unwrap_or_default();
    let svc = r.services.iter().find(|s| name_of(&s.metadata) == host);
    let spec = svc.and_then(|s| s.spec.clone()).unwrap_or_default();
    let sel = spec.selector.clone().unwrap_or_default();
    let selected = ws.iter().filter(|w| selects(&sel, &w.labels()));
    selected
        .map(|w| match service_target(&spec, w, port) {
            Some(target) => Ok((w, target)),
            None => Err(format!(
                "Service {host} port {port} leads to no container port"
            )),
        })
        .collect()
}

/// The container port a Service's `port` leads to on `w`'s pods.
fn service_target(
    spec: &k8s_openapi::api::core::v1::ServiceSpec,
    w: &Workload,
    port: i32,
) -> Option<i32> {
    let sp = spec.ports.iter().flatten().find(|sp| sp.port == port)?;
    match sp.target_port.clone().unwrap_or(IntOrString::Int(port)) {
        IntOrString::Int(n) => Some(n),
        IntOrString::String(name) => w.running().into_iter().find_map(|(_, c)| {
            let mut ports = c.ports.iter().flatten();
            let cp = ports.find(|cp| cp.name.as_deref() == Some(name.as_str()))?;
            Some(cp.container_port)
        }),
    }
}

/// The Secret (name, key) the env variable `name` of `c` comes from.
fn secret_env(c: &Container, name: &str) -> Option<(String, String)> {
    let e = c.env.iter().flatten().find(|e| e.name == name)?;
    let r = e.value_from.as_ref()?.secret_key_ref.as_ref()?;
    Some((r.name.clone(), r.key.clone()))
}

/// Whether the NetworkPolicies of the render let `from`'s pods open a TCP connection to
/// `to`'s pods on the container port `port` (0: on every port), as Kubernetes decides it:
/// the policies with `Ingress` among their types (the default) that select `to`'s pods must
/// together have a rule admitting `from`'s pods on the port, or none may select them; and
/// likewise for `Egress` policies selecting `from`'s pods, with their rules' `to` peers.
/// Only `podSelector` peers of this namespace are evaluated (a peer with a
/// `namespaceSelector` or an `ipBlock` admits nothing here).
fn admits(r: &Rendered, from: &Workload, to: &Workload, port: i32) -> bool {
    use k8s_openapi::api::networking::v1::{NetworkPolicyPeer, NetworkPolicyPort};
    let peer_ok = |peer: &NetworkPolicyPeer, w: &Workload| match peer {
        NetworkPolicyPeer {
            pod_selector: Some(ps),
            namespace_selector: None,
            ip_block: None,
        } => selects(&ps.match_labels.clone().unwrap_or_default(), &w.labels()),
        _ => false,
    };
    let port_ok = |np: &NetworkPolicyPort| {
        let tcp = np.protocol.as_deref().unwrap_or("TCP") == "TCP";
        let matches = match &np.port {
            None => true,
            Some(IntOrString::Int(n)) => {
                *n == port || np.end_port.is_some_and(|end| port > *n && port <= end)
            }
            Some(IntOrString::String(name)) => to.running().iter().any(|(_, c)| {
                let mut ports = c.ports.iter().flatten();
                ports.any(|cp| cp.container_port == port && cp.name.as_deref() == Some(name))
            }),
        };
        // Port 0 asks for every port: only a rule without a port admits it.
        tcp && matches && (port != 0 || np.port.is_none())
    };
    let ports_ok = |ports: Option<&Vec<NetworkPolicyPort>>| {
        ports.is_none_or(|ps| ps.is_empty() || ps.iter().any(port_ok))
    };
    let applies =
        |spec: &k8s_openapi::api::networking::v1::NetworkPolicySpec, w: &Workload, kind: &str| {
            let sel = spec.pod_selector.clone().unwrap_or_default();
            let types = spec.policy_types.clone();
            let typed = match &types {
                Some(t) => t.iter().any(|t| t == kind),
                // Unset: Ingress, and Egress too when the policy has egress rules.
                None => kind == "Ingress" || spec.egress.is_some(),
            };
            typed && selects(&sel.match_labels.unwrap_or_default(), &w.labels())
        };
    let specs: Vec<_> = r
        .network_policies
        .iter()
        .filter_map(|n| n.spec.as_ref())
        .collect();
    let ingress: Vec<_> = specs.iter().filter(|s| applies(s, to, "Ingress")).collect();
    let ingress_ok = ingress.is_empty()
        || ingress.iter().any(|spec| {
            spec.ingress.iter().flatten().any(|rule| {
                let peers = rule.from.as_ref();
                peers.is_none_or(|f| f.is_empty() || f.iter().any(|p| peer_ok(p, from)))
                    && ports_ok(rule.ports.as_ref())
            })
        });
    let egress: Vec<_> = specs
        .iter()
        .filter(|s| applies(s, from, "Egress"))
        .collect();
    let egress_ok = egress.is_empty()
        || egress.iter().any(|spec| {
            spec.egress.iter().flatten().any(|rule| {
                let peers = rule.to.as_ref();
                peers.is_none_or(|t| t.is_empty() || t.iter().any(|p| peer_ok(p, to)))
                    && ports_ok(rule.ports.as_ref())
            })
        });
    ingress_ok && egress_ok
}

fn check_learner(
    w: &Workload,
    path: &str,
    c: &Container,
    config: &RunToml,
    fail: &mut impl FnMut(String, String),
) {
    let world = config.number("learner", "world_size", 1.0);
    let env_world = env_value(c, "TUTOR_LEARNER_WORLD_SIZE");
    if f64::from(w.replicas) != world || env_world.as_deref() != Some(&*world.to_string()) {
        let why = format!(
            "{} ranks, TUTOR_LEARNER_WORLD_SIZE {env_world:?} and [learner] world_size {world} \
             must agree",
            w.replicas
        );
        fail("spec.replicas".into(), why);
    }
    let collective = config.text("learner", "collective", "cpu");
    if env_value(c, "TUTOR_LEARNER_COLLECTIVE").as_deref() != Some(&*collective) {
        fail(
            format!("{path}.env"),
            format!("TUTOR_LEARNER_COLLECTIVE is not [learner] collective ({collective})"),
        );
    }
    let device = config.text("learner", "device", "cpu");
    if device.starts_with("cuda") != (gpus(c) >= 1.0) {
        fail(
            format!("{path}.resources.limits"),
            format!("{} nvidia.com/gpu for [learner] device {device:?}", gpus(c)),
        );
    }
    if collective == "nccl" && !has_memory_shm(w, c) {
        fail(
            format!("{path}.volumeMounts"),
            "NCCL needs a Memory emptyDir mounted at /dev/shm".into(),
        );
    }
}

fn check_worker(
    (path, worker): (String, &Container),
    (engine_path, engine): (String, &Container),
    config: &RunToml,
    fail: &mut impl FnMut(String, String),
) {
    let device = config.text("worker", "student_device", "cpu");
    if device.starts_with("cuda") != (gpus(worker) >= 1.0) {
        let why = format!(
            "{} nvidia.com/gpu for [worker] student_device {device:?}",
            gpus(worker)
        );
        fail(format!("{path}.resources.limits"), why);
    }
    if env_value(worker, "DOCKER_HOST").as_deref() != Some("tcp://127.0.0.1:2375") {
        fail(
            format!("{path}.env"),
            "DOCKER_HOST must be the sidecar's tcp://127.0.0.1:2375".into(),
        );
    }
    // Episode containers live in the engine's cgroup.
    let capacity = config.number("worker", "capacity", 1.0);
    let memory = capacity * config.number("worker", "memory_mb", 2048.0) * 1048576.0;
    let cpus = capacity * config.number("worker", "cpus", 1.0);
    if limit(engine, "memory") < memory || limit(engine, "cpu") < cpus {
        let why = format!("below [worker] capacity ({capacity}) x memory_mb and cpus");
        fail(format!("{engine_path}.resources.limits"), why);
    }
}

fn env_value(c: &Container, name: &str) -> Option<String> {
    let e = c.env.iter().flatten().find(|e| e.name == name);
    e.and_then(|e| e.value.clone())
}

/// A container's limit of `resource`, in base units (0 when unset).
fn limit(c: &Container, resource: &str) -> f64 {
    let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
    let q = limits
        .and_then(|l| l.get(resource))
        .and_then(|q| quantity(&q.0));
    q.unwrap_or(0.0)
}

fn gpus(c: &Container) -> f64 {
    limit(c, "nvidia.com/gpu")
}

fn has_memory_shm(w: &Workload, c: &Container) -> bool {
    let mounts = c.volume_mounts.iter().flatten();
    let Some(m) = mounts.into_iter().find(|m| m.mount_path == "/dev/shm") else {
        return false;
    };
    let volumes = w
        .template
        .spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten());
    let mut volumes = volumes;
    volumes.any(|v| {
        v.name == m.name && v.empty_dir.as_ref().and_then(|e| e.medium.as_deref()) == Some("Memory")
    })
}

// ---------------------------------------------------------------------------------------
// The tests.

/// deploy/k8s copied to a temporary folder, with the example secrets as secrets.env (an
/// operator's own secrets.env is neither copied nor read).
fn staged() -> tempfile::TempDir {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let (src, dst) = (entry.path(), to.join(entry.file_name()));
            if src.is_dir() {
                copy(&src, &dst);
            } else if entry.file_name() != "secrets.env" {
                std::fs::copy(&src, &dst).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let k8s = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s");
    copy(&k8s, dir.path());
    let base = dir.path().join("base");
    std::fs::copy(base.join("secrets.env.example"), base.join("secrets.env")).unwrap();
    dir
}

/// Renders an overlay of a staged tree and checks it.
fn problems(tree: &Path, overlay: &str) -> (Rendered, Vec<String>) {
    let mut p = Problems::default();
    let objects = match render(&tree.join("overlays").join(overlay)) {
        Ok(o) => o,
        Err(e) => {
            return (
                Rendered::default(),
                vec![format!("{overlay}: rendering: {e}")],
            )
        }
    };
    check_metadata(overlay, &objects, &mut p);
    let r = read_typed(overlay, &objects, &mut p);
    check(&r, &mut p);
    (r, p.0)
}

fn tutor_images(r: &Rendered) -> BTreeSet<String> {
    workloads(r)
        .iter()
        .flat_map(|w| w.containers().into_iter().map(|(_, c)| c.clone()))
        .filter(is_tutor)
        .filter_map(|c| c.image)
        .collect()
}

#[test]
fn overlays_render_to_api_objects_whose_references_resolve() {
    let tree = staged();
    for overlay in OVERLAYS {
        let (r, problems) = problems(tree.path(), overlay);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        let ws = workloads(&r);
        let role = |name: &str| ws.iter().find(|w| w.role() == name).unwrap();
        let (learner, worker) = (role("learner"), role("worker"));
        let learner_gpus = learner
            .container_named("learner")
            .and_then(|c| c.resources.clone()?.limits?.get("nvidia.com/gpu").cloned());
        match overlay {
            "cpu" | "engine" => {
                let workers = if overlay == "cpu" { 2 } else { 4 };
                assert_eq!(
                    (learner.replicas, worker.replicas),
                    (1, workers),
                    "{overlay}"
                );
                assert_eq!(learner_gpus, None, "{overlay}: no GPUs");
                assert_eq!(
                    tutor_images(&r),
                    BTreeSet::from(["registry.invalid/tutor:latest".to_string()])
                );
                // The student's engine: one tutor serve, required only by the engine
                // overlay (check_student_engine checks how it is reached).
                let engine = ws.iter().find(|w| w.role() == "engine");
                assert_eq!(
                    engine.map(|e| e.replicas),
                    (overlay == "engine").then_some(1),
                    "{overlay}"
                );
            }
            _ => {
                assert!(learner.replicas >= 2, "{overlay}: data-parallel learner");
                assert_eq!(
                    learner_gpus.map(|q| q.0),
                    Some("1".to_string()),
                    "{overlay}"
                );
                let c = learner.container_named("learner").unwrap();
                assert!(has_memory_shm(learner, c), "{overlay}: /dev/shm in memory");
                assert_eq!(
                    tutor_images(&r),
                    BTreeSet::from(["registry.invalid/tutor:gpu".to_string()])
                );
            }
        }
        // Each role mounts its own token only: the run's for the coordinator, the
        // derived learner and worker tokens for the others (a stolen learner or worker
        // token cannot shut the run down).
        for (name, keys) in [
            ("coordinator", vec!["auth-token"]),
            ("learner", vec!["learner-token"]),
            ("worker", vec!["worker-token"]),
        ] {
            let mounted: Vec<String> = role(name)
                .template
                .spec
                .as_ref()
                .and_then(|s| s.volumes.clone())
                .unwrap_or_default()
                .into_iter()
                .filter_map(|v| v.secret)
                .filter(|s| s.secret_name.as_deref() == Some("tutor-secrets"))
                .flat_map(|s| s.items.unwrap_or_default())
                .map(|i| i.key)
                .collect();
            assert_eq!(mounted, keys, "{overlay}: the {name}'s Secret keys");
        }
        // The secret came from the placeholder example: all five keys, no real token.
        let secret = r
            .secrets
            .iter()
            .find(|s| name_of(&s.metadata) == "tutor-secrets")
            .unwrap();
        let keys: Vec<&String> = secret.data.as_ref().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "auth-token",
                "engine-api-key",
                "learner-token",
                "teacher-api-key",
                "worker-token"
            ]
        );
    }
}

/// Each overlay's config is a run config `tutor prepare` accepts (RunConfig::load's
/// parsing and validation, unknown fields refused) and prepares a run directory from, as
/// the init containers do; twice into the same directory, as after a pod restart.
#[test]
fn each_overlays_config_prepares_a_run_directory_twice() {
    let tree = staged();
    for overlay in OVERLAYS {
        let (r, _) = problems(tree.path(), overlay);
        let cm = r
            .config_maps
            .iter()
            .find(|c| name_of(&c.metadata) == "tutor-config")
            .unwrap();
        let text = &cm.data.as_ref().unwrap()["config.toml"];
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.toml");
        std::fs::write(&config, text).unwrap();
        let run_dir = dir.path().join("run");
        for attempt in ["first", "again"] {
            let out = Command::new(common::tutor_bin())
                .args(["prepare", "--config"])
                .arg(&config)
                .arg("--run-dir")
                .arg(&run_dir)
                .env("TUTOR_PYTHON", common::python())
                .output()
                .expect("running tutor prepare");
            assert!(
                out.status.success(),
                "{overlay}: tutor prepare ({attempt}) of the rendered config.toml failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for f in [
            "tasks/train.jsonl",
            "tasks/heldout.jsonl",
            "model/config.json",
            "model/tokenizer.json",
        ] {
            assert!(run_dir.join(f).is_file(), "{overlay}: {f} not prepared");
        }
    }
}

/// The engine overlay's run, on this machine. Its engine is started as engine.yaml starts
/// it: the container's own arguments, only the address, the port and the model directory
/// made local, in a run directory `tutor prepare` made from the rendered config as the
/// engine's init container does (config.json and tokenizer.json, no weights: `--load-format
/// dummy`), with the key from the environment. Then `tutor run` on the rendered config.toml,
/// overridden only where a machine differs from the cluster: the engine's and the
/// learner's addresses, local sandboxes instead of the Docker sidecars, two workers, a
/// shorter run. The learner loads every version into the engine, once each; the workers
/// generate every student turn there, log-probs and all, and never load a version; the
/// run finishes its DAgger iterations.
#[test]
fn the_engine_overlays_run_trains_with_the_learner_loading_its_engine() {
    let tree = staged();
    let (r, problems) = problems(tree.path(), "engine");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let cm = r
        .config_maps
        .iter()
        .find(|c| name_of(&c.metadata) == "tutor-config")
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(&config, &cm.data.as_ref().unwrap()["config.toml"]).unwrap();

    // The engine pod: its init container, then its container.
    let engine_run = dir.path().join("engine-run");
    let out = Command::new(common::tutor_bin())
        .args(["prepare", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&engine_run)
        .env("TUTOR_PYTHON", common::python())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ws = workloads(&r);
    let engine = ws.iter().find(|w| w.role() == "engine").unwrap();
    let mut args = engine
        .container_named("engine")
        .unwrap()
        .args
        .clone()
        .unwrap();
    for (flag, value) in [
        ("--model", engine_run.join("model").display().to_string()),
        ("--host", "127.0.0.1".into()),
        ("--port", "0".into()),
    ] {
        let i = args.iter().position(|a| a == flag).expect(flag);
        args[i + 1] = value;
    }
    let key = "engine-overlay-test-key";
    let served = common::serve_with(&args, dir.path(), &[("TUTOR_SERVE_API_KEY", key)]);

    let out_dir = dir.path().join("runs");
    let engine_url = format!("http://{}", served.addr);
    let overrides = [
        ("TUTOR_RUN__OUT_DIR", out_dir.to_str().unwrap()),
        ("TUTOR_RUN__WORKERS", "2"),
        ("TUTOR_WORKER__SANDBOX", "local"),
        ("TUTOR_WORKER__STUDENT__BASE_URL", engine_url.as_str()),
        ("TUTOR_LEARNER__ENGINE_GROUP_LISTEN", "127.0.0.1:0"),
        ("TUTOR_LEARNER__ENGINE_GROUP_ADDRESS", "127.0.0.1"),
        ("TUTOR_STUDENT_API_KEY", key),
        ("TUTOR_COORDINATOR__ITERATIONS", "2"),
        ("TUTOR_COORDINATOR__EPISODES_PER_ITERATION", "4"),
        ("TUTOR_COORDINATOR__HELDOUT_EPISODES", "2"),
        ("TUTOR_COORDINATOR__FINAL_HELDOUT_EPISODES", "2"),
        ("TUTOR_COORDINATOR__EPOCHS_PER_ITERATION", "1"),
        ("TUTOR_COORDINATOR__MAX_STEPS_PER_ITERATION", "2"),
    ];
    let out = Command::new(common::tutor_bin())
        .args(["run", "--config"])
        .arg(&config)
        .env("TUTOR_PYTHON", common::python())
        .envs(overrides)
        .output()
        .unwrap();
    let serve_log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    let runs: Vec<PathBuf> = std::fs::read_dir(&out_dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let logs = |role: &str| {
        runs.first()
            .map(|run| common::role_logs(run, role))
            .unwrap_or_default()
    };
    assert!(
        out.status.success(),
        "tutor run failed\nstderr:\n{}\nlearner:\n{}\nworkers:\n{}\nengine:\n{serve_log}",
        String::from_utf8_lossy(&out.stderr),
        logs("learner"),
        logs("worker"),
    );
    let run = &runs[0];
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    assert!(
        serve_log.contains("--load-format dummy: serving placeholder weights"),
        "{serve_log}"
    );

    // Every student turn came from the engine, under a version the learner loaded into it.
    let (events, _) = tutor_coordinator::store::scan(&run.join("trajectories/events.log")).unwrap();
    let mut versions = BTreeSet::new();
    let mut student_turns = 0;
    for ev in &events {
        match ev.event.as_ref() {
            Some(Event::Turn(t)) if !t.student_tokens.is_empty() => {
                student_turns += 1;
                assert_eq!(t.student_logprobs.len(), t.student_tokens.len());
            }
            Some(Event::Outcome(o)) => {
                // No turn failed on the engine (down, refused, another version's answer).
                assert_ne!(
                    o.status,
                    tutor_proto::OutcomeStatus::SandboxError as i32,
                    "{}: {}",
                    ev.episode_id,
                    o.error
                );
                versions.insert(o.policy_version);
            }
            _ => {}
        }
    }
    eprintln!(
        "{student_turns} student turns over {} events, episodes of versions {versions:?}\n\
         metrics.jsonl:\n{metrics}",
        events.len()
    );
    assert!(student_turns > 0, "no turn of the student's was stored");
    assert!(versions.len() >= 2, "episodes of versions {versions:?}");
    let worker_log = logs("worker");
    common::assert_the_learner_loaded_each_version_once(
        &versions,
        &logs("learner"),
        &worker_log,
        &serve_log,
    );
    assert!(
        worker_log.contains("student engine answers"),
        "{worker_log}"
    );
}

/// Broken copies of the manifests fail, naming the object and the field.
#[test]
fn a_broken_manifest_fails_naming_the_object_and_field() {
    // (file, text, replaced by, overlay, the problem's start after "OVERLAY: ")
    let cases = [
        // A Service port aimed at a port no pod has.
        (
            "base/coordinator.yaml",
            "    targetPort: metrics",
            "    targetPort: metric",
            "cpu",
            "Service/tutor-coordinator: spec.ports[1].targetPort",
        ),
        // A misspelt field, which the API server would drop without a word.
        (
            "base/worker.yaml",
            "      serviceAccountName: tutor",
            "      serviceAcountName: tutor",
            "cpu",
            "StatefulSet/tutor-worker: spec.template.spec.serviceAcountName",
        ),
        // A secret key that does not exist.
        (
            "base/worker.yaml",
            "key: teacher-api-key",
            "key: teacher-key",
            "cpu",
            "StatefulSet/tutor-worker: spec.template.spec.containers[0].env[3].valueFrom",
        ),
        // Learner ranks that disagree with the config.
        (
            "overlays/gpu/kustomization.yaml",
            "value: \"2\"",
            "value: \"3\"",
            "gpu",
            "StatefulSet/tutor-learner: spec.replicas",
        ),
        // A JSON patch whose index no longer names the entry it means.
        (
            "base/learner.yaml",
            "        - name: TUTOR_LEARNER_WORLD_SIZE\n          value: \"1\"\n",
            "",
            "gpu",
            "rendering",
        ),
        // An address no Service answers.
        (
            "base/worker.yaml",
            "        - http://tutor-coordinator:7300",
            "        - http://tutor-coordinator:7400",
            "cpu",
            "StatefulSet/tutor-worker: spec.template.spec.containers[0].args[6]",
        ),
        // A variable Kubernetes would leave unexpanded.
        (
            "base/learner.yaml",
            "$(POD_NAME).tutor-learner",
            "$(POD).tutor-learner",
            "cpu",
            "StatefulSet/tutor-learner: spec.template.spec.containers[0].env[5].value",
        ),
        // A network policy opening a port the pods do not have.
        (
            "base/networkpolicy.yaml",
            "port: 7301",
            "port: 7302",
            "cpu",
            "NetworkPolicy/tutor-learner: spec.ingress[0].ports[0].port",
        ),
        // The engine's pods kept from the learner's weight-update port.
        (
            "overlays/engine/kustomization.yaml",
            "        - protocol: TCP\n          port: 7320",
            "        - protocol: TCP\n          port: 7321",
            "engine",
            "ConfigMap/tutor-config: data.config.toml: no NetworkPolicy lets the engine's pods",
        ),
        // Several engines' port 0 without a rule letting the engines reach any port.
        (
            "overlays/engine/config.toml",
            "engine_group_listen = \"0.0.0.0:7320\"",
            "engine_group_listen = \"0.0.0.0:0\"",
            "engine",
            "ConfigMap/tutor-config: data.config.toml: no NetworkPolicy lets the engine's pods \
             reach StatefulSet/tutor-learner on any port",
        ),
        // The engine's port opened for UDP only: the workers' turns cannot reach it.
        (
            "overlays/engine/engine.yaml",
            "    - protocol: TCP\n      port: 8000",
            "    - protocol: UDP\n      port: 8000",
            "engine",
            "ConfigMap/tutor-config: data.config.toml: no NetworkPolicy lets the worker's pods \
             reach Deployment/tutor-engine on port 8000",
        ),
        // An engine that would refuse the weights the learner sends.
        (
            "overlays/engine/engine.yaml",
            "        - --distributed-updates\n",
            "",
            "engine",
            "ConfigMap/tutor-config: data.config.toml: [worker.student] reload = \"distributed\"",
        ),
        // An engine batch smaller than the workers' turns.
        (
            "overlays/engine/engine.yaml",
            "        - \"8\"",
            "        - \"2\"",
            "engine",
            "ConfigMap/tutor-config: data.config.toml: Deployment/tutor-engine",
        ),
    ];
    for (file, from, to, overlay, expected) in cases {
        let tree = staged();
        let path = tree.path().join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches(from).count(), 1, "{file}: {from:?} once");
        std::fs::write(&path, text.replace(from, to)).unwrap();
        let (_, problems) = problems(tree.path(), overlay);
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with(&format!("{overlay}: {expected}"))),
            "{file} with {to:?}: expected a problem starting {overlay}: {expected}, got:\n{}",
            problems.join("\n")
        );
    }
}

#[test]
fn json_patches_and_generators_render_as_kustomize_does() {
    let mut doc = json!({"a": {"list": [1, 3]}});
    let op = |op: &str, path: &str, value: Option<Value>| Op {
        op: op.into(),
        path: path.into(),
        value,
    };
    apply_op(&mut doc, &op("add", "/a/list/1", Some(json!(2)))).unwrap();
    apply_op(&mut doc, &op("add", "/a/list/-", Some(json!(4)))).unwrap();
    apply_op(&mut doc, &op("add", "/a/b~1c", Some(json!("x")))).unwrap();
    apply_op(&mut doc, &op("replace", "/a/list/0", Some(json!(0)))).unwrap();
    apply_op(&mut doc, &op("test", "/a/list/0", Some(json!(0)))).unwrap();
    apply_op(&mut doc, &op("remove", "/a/list/3", None)).unwrap();
    assert_eq!(doc, json!({"a": {"list": [0, 2, 3], "b/c": "x"}}));
    assert!(apply_op(&mut doc, &op("test", "/a/list/0", Some(json!(1)))).is_err());
    assert!(apply_op(&mut doc, &op("replace", "/a/nothing", Some(json!(1)))).is_err());
    assert!(apply_op(&mut doc, &op("remove", "/a/list/9", None)).is_err());

    assert_eq!(split_image("tutor/tutor:gpu"), ("tutor/tutor", ":gpu"));
    assert_eq!(
        split_image("reg:5000/tutor/tutor"),
        ("reg:5000/tutor/tutor", "")
    );
    assert_eq!(split_image("docker@sha256:ab"), ("docker", "@sha256:ab"));

    // replace keeps the base's metadata and takes the new data; merge unites the data.
    let old = json!({
        "kind": "ConfigMap",
        "metadata": {"name": "c", "labels": {"a": "1"}},
        "data": {"x": "1", "y": "1"},
    });
    let new = json!({"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"y": "2"}});
    let mut objects = vec![old.clone()];
    absorb(&mut objects, new.clone(), "replace").unwrap();
    assert_eq!(objects[0]["data"], json!({"y": "2"}));
    assert_eq!(objects[0]["metadata"]["labels"], json!({"a": "1"}));
    let mut objects = vec![old];
    absorb(&mut objects, new.clone(), "merge").unwrap();
    assert_eq!(objects[0]["data"], json!({"x": "1", "y": "2"}));
    assert!(absorb(&mut objects, new.clone(), "create").is_err());
    assert!(absorb(&mut Vec::new(), new, "replace").is_err());

    assert_eq!(quantity("500m"), Some(0.5));
    assert_eq!(quantity("3Gi"), Some(3.0 * 1073741824.0));
    assert_eq!(quantity("2"), Some(2.0));
    assert_eq!(references("$(POD_NAME).svc:$(PORT)"), ["POD_NAME", "PORT"]);
}

/// Where kubectl is installed, its kustomize (which `kubectl apply -k` runs) renders every
/// overlay to exactly the objects the renderer above does.
#[test]
fn the_renderer_agrees_with_kubectl_kustomize() {
    let tree = staged();
    for overlay in OVERLAYS {
        let dir = tree.path().join("overlays").join(overlay);
        let out = match Command::new("kubectl").arg("kustomize").arg(&dir).output() {
            Ok(out) => out,
            Err(_) => {
                eprintln!("skipped: no kubectl on PATH");
                return;
            }
        };
        assert!(
            out.status.success(),
            "{overlay}: kubectl kustomize refused it:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let by_id = |objects: Vec<Value>| -> BTreeMap<String, Value> {
            objects.into_iter().map(|o| (id(&o), o)).collect()
        };
        let text = String::from_utf8(out.stdout).unwrap();
        let theirs = serde_norway::Deserializer::from_str(&text)
            .map(|doc| Value::deserialize(doc).unwrap())
            .filter(|v| !v.is_null())
            .collect();
        let (theirs, ours) = (by_id(theirs), by_id(render(&dir).unwrap()));
        assert_eq!(
            theirs.keys().collect::<Vec<_>>(),
            ours.keys().collect::<Vec<_>>(),
            "{overlay}"
        );
        for (id, o) in &ours {
            assert_eq!(&theirs[id], o, "{overlay}: {id} rendered differently");
        }
    }
}
