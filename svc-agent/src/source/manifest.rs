//! Services and EndpointSlices from YAML manifest files.
//!
//! The loader is deliberately forgiving: every problem becomes an [`Error`] that names the
//! file, the document and (where known) the object, and loading carries on with the next
//! document. A typo in one Service must never take the other Services down with it.

use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::Metadata;
use serde_yaml::{Mapping, Value};
use tracing::{debug, instrument};

use crate::error::Error;

/// A loaded object and where it came from, so later errors can point back at the file.
#[derive(Clone, Debug, PartialEq)]
pub struct Named<T> {
    pub object: T,
    pub path: PathBuf,
    /// Position of the document in its file, counting from 1.
    pub doc: usize,
    /// Position inside a `kind: List` document, counting from 1.
    pub item: Option<usize>,
}

impl<T> Named<T> {
    /// "path: document N" or "path: document N, item M", for log lines.
    pub fn origin(&self) -> String {
        match self.item {
            Some(item) => format!(
                "{}: document {}, item {item}",
                self.path.display(),
                self.doc
            ),
            None => format!("{}: document {}", self.path.display(), self.doc),
        }
    }
}

/// Everything read from a manifest path, including what could not be read.
#[derive(Debug, Default)]
pub struct Loaded {
    pub services: Vec<Named<Service>>,
    pub slices: Vec<Named<EndpointSlice>>,
    pub errors: Vec<Error>,
}

const SERVICE_API_VERSION: &str = "v1";
const SLICE_API_VERSION: &str = "discovery.k8s.io/v1";

/// Reads Services and EndpointSlices from `path`: one file with any number of YAML
/// documents (or a JSON file), or a directory whose `*.yaml`, `*.yml` and `*.json` files are
/// read in name order. Never fails as a whole; see [`Loaded::errors`].
#[instrument(skip_all, fields(path = %path.display()))]
pub fn load(path: &Path) -> Loaded {
    let mut out = Loaded::default();
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(source) => {
            out.errors.push(io_error(path, source));
            return out;
        }
    };
    if meta.is_dir() {
        for file in manifest_files(path, &mut out.errors) {
            load_file(&file, &mut out);
        }
    } else {
        load_file(path, &mut out);
    }
    debug!(
        services = out.services.len(),
        slices = out.slices.len(),
        errors = out.errors.len(),
        "manifests loaded"
    );
    out
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The manifest files directly inside `dir`, sorted by name so that "first wins" rules
/// downstream give the same answer on every run.
fn manifest_files(dir: &Path, errors: &mut Vec<Error>) -> Vec<PathBuf> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(source) => {
            errors.push(io_error(dir, source));
            return Vec::new();
        }
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(source) => {
                errors.push(io_error(dir, source));
                continue;
            }
        };
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // Hidden files are editor backups and the like; a ConfigMap volume's `..data`
        // machinery is hidden too, and its files are reachable through the visible symlinks.
        if name.starts_with('.') {
            continue;
        }
        let wanted = path
            .extension()
            .and_then(|ext| ext.to_str())
            .is_some_and(|ext| {
                ["yaml", "yml", "json"]
                    .iter()
                    .any(|want| ext.eq_ignore_ascii_case(want))
            });
        // fs::metadata follows symlinks, which ConfigMap volumes consist of.
        if wanted && fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            files.push(path);
        }
    }
    files.sort();
    files
}

fn is_json(path: &Path) -> bool {
    path.extension()
        .and_then(|ext| ext.to_str())
        .is_some_and(|ext| ext.eq_ignore_ascii_case("json"))
}

fn load_file(path: &Path, out: &mut Loaded) {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(source) => {
            out.errors.push(io_error(path, source));
            return;
        }
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let before = (out.services.len(), out.slices.len(), out.errors.len());
    if is_json(path) {
        load_json(path, text, out);
    } else {
        load_yaml(path, text, out);
    }
    debug!(
        file = %path.display(),
        services = out.services.len() - before.0,
        slices = out.slices.len() - before.1,
        errors = out.errors.len() - before.2,
        "file read"
    );
}

fn load_yaml(path: &Path, text: &str, out: &mut Loaded) {
    for (index, chunk) in split_documents(text).into_iter().enumerate() {
        let doc = index + 1;
        // serde_yaml 0.9 is unmaintained and has been seen to panic on malformed input; a
        // panic must cost one document, not the agent.
        let parsed = panic::catch_unwind(|| parse_yaml_document(chunk));
        match parsed {
            Ok(Ok(value)) => add_document(value, path, doc, out),
            Ok(Err(message)) => out.errors.push(manifest_error(path, doc, message)),
            Err(_) => out.errors.push(manifest_error(
                path,
                doc,
                "the YAML parser crashed on this document".to_string(),
            )),
        }
    }
}

fn load_json(path: &Path, text: &str, out: &mut Loaded) {
    // kubectl accepts a stream of concatenated JSON objects, so we do too.
    let stream = serde_json::Deserializer::from_str(text).into_iter::<serde_json::Value>();
    for (index, value) in stream.enumerate() {
        let doc = index + 1;
        let value = match value {
            Ok(value) => value,
            Err(e) => {
                // A JSON syntax error leaves no reliable place to resume from.
                out.errors
                    .push(manifest_error(path, doc, format!("invalid JSON: {e}")));
                return;
            }
        };
        match serde_yaml::to_value(value) {
            Ok(value) => add_document(value, path, doc, out),
            Err(e) => out
                .errors
                .push(manifest_error(path, doc, format!("invalid JSON: {e}"))),
        }
    }
}

fn manifest_error(path: &Path, doc: usize, message: String) -> Error {
    Error::Manifest {
        path: path.to_path_buf(),
        doc,
        message,
    }
}

/// One YAML document's text and the 0-based line it starts on.
#[derive(Debug, PartialEq)]
struct Chunk<'a> {
    first_line: usize,
    text: &'a str,
}

/// Splits a YAML stream at its `---` document markers.
///
/// serde_yaml's multi-document iterator cannot be used for this: after a syntax error it
/// repeats that error forever instead of moving to the next document, and after some
/// semantic errors it panics. A `---` at the start of a line always starts a new document
/// (YAML forbids it inside scalars), so a textual split is exact.
fn split_documents(text: &str) -> Vec<Chunk<'_>> {
    let mut starts: Vec<(usize, usize)> = Vec::new(); // (byte offset, line)
    let mut offset = 0;
    for (line_no, line) in text.split_inclusive('\n').enumerate() {
        if is_document_marker(line) {
            starts.push((offset, line_no));
        }
        offset += line.len();
    }
    // Comments and directives before the first marker belong to the first document; any
    // real content there is an implicit document of its own.
    let prefix_end = starts.first().map_or(text.len(), |&(at, _)| at);
    let prefix_is_trivia = text[..prefix_end].lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#') || line.starts_with('%')
    });
    if starts.first().is_some_and(|&(at, _)| at > 0) && !prefix_is_trivia {
        starts.insert(0, (0, 0));
    } else if let Some(first) = starts.first_mut() {
        *first = (0, 0);
    } else {
        starts.push((0, 0));
    }
    let mut chunks = Vec::with_capacity(starts.len());
    for (i, &(at, first_line)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(text.len(), |&(next, _)| next);
        chunks.push(Chunk {
            first_line,
            text: &text[at..end],
        });
    }
    chunks
}

fn is_document_marker(line: &str) -> bool {
    line.strip_prefix("---")
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r', '\n']))
}

fn parse_yaml_document(chunk: Chunk<'_>) -> Result<Value, String> {
    match serde_yaml::from_str::<Value>(chunk.text) {
        Ok(value) => Ok(value),
        Err(e) if chunk.first_line == 0 || e.location().is_none() => {
            Err(format!("invalid YAML: {e}"))
        }
        Err(_) => {
            // The parser numbers lines from the start of what it was given; parse again behind
            // blank lines so the message points at the line in the file. Only errors pay.
            let padded = format!("{}{}", "\n".repeat(chunk.first_line), chunk.text);
            match serde_yaml::from_str::<Value>(&padded) {
                Err(e) => Err(format!("invalid YAML: {e}")),
                Ok(_) => Err("invalid YAML".to_string()),
            }
        }
    }
}

/// What a document claims to be, for error messages before it is known to be valid.
struct Header {
    api_version: Option<String>,
    kind: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
}

impl Header {
    fn of(map: &Mapping) -> Header {
        let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
        let metadata = map.get("metadata");
        Header {
            api_version: text(map.get("apiVersion")),
            kind: text(map.get("kind")),
            namespace: text(metadata.and_then(|m| m.get("namespace"))),
            name: text(metadata.and_then(|m| m.get("name"))),
        }
    }

    /// "Service ns/name", as far as it is known.
    fn describe(&self) -> String {
        let kind = self.kind.as_deref().unwrap_or("object");
        let namespace = match self.namespace.as_deref() {
            None | Some("") => "default",
            Some(ns) => ns,
        };
        match self.name.as_deref() {
            Some(name) if !name.is_empty() => format!("{kind} {namespace}/{name}"),
            _ => format!("{kind} (unnamed)"),
        }
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

fn add_document(value: Value, path: &Path, doc: usize, out: &mut Loaded) {
    let at = Location {
        path,
        doc,
        item: None,
    };
    // Editors and templating leave empty documents behind (`---` at the end of a file); they
    // mean nothing.
    if value.is_null() {
        return;
    }
    add_object(value, at, true, out);
}

#[derive(Clone, Copy)]
struct Location<'a> {
    path: &'a Path,
    doc: usize,
    item: Option<usize>,
}

impl Location<'_> {
    fn error(&self, message: String) -> Error {
        let message = match self.item {
            Some(item) => format!("item {item}: {message}"),
            None => message,
        };
        manifest_error(self.path, self.doc, message)
    }

    fn named<T>(&self, object: T) -> Named<T> {
        Named {
            object,
            path: self.path.to_path_buf(),
            doc: self.doc,
            item: self.item,
        }
    }
}

fn add_object(value: Value, at: Location<'_>, lists_allowed: bool, out: &mut Loaded) {
    let Value::Mapping(map) = value else {
        out.errors.push(at.error(format!(
            "expected a Kubernetes object (a mapping), found {}",
            type_name(&value)
        )));
        return;
    };
    let header = Header::of(&map);
    let (Some(api_version), Some(kind)) = (header.api_version.as_deref(), header.kind.as_deref())
    else {
        out.errors.push(at.error(format!(
            "{}: apiVersion and kind are required",
            header.describe()
        )));
        return;
    };
    match (api_version, kind) {
        (SERVICE_API_VERSION, "Service") => {
            if let Some(service) = typed::<Service>(Value::Mapping(map), &header, at, out) {
                out.services.push(at.named(service));
            }
        }
        (SLICE_API_VERSION, "EndpointSlice") => {
            if let Some(slice) = typed::<EndpointSlice>(Value::Mapping(map), &header, at, out) {
                out.slices.push(at.named(slice));
            }
        }
        ("v1", "List") if lists_allowed => add_list(map, None, at, out),
        // What the API itself returns: the items carry no kind/apiVersion of their own.
        (SERVICE_API_VERSION, "ServiceList") if lists_allowed => {
            add_list(map, Some((SERVICE_API_VERSION, "Service")), at, out)
        }
        (SLICE_API_VERSION, "EndpointSliceList") if lists_allowed => {
            add_list(map, Some((SLICE_API_VERSION, "EndpointSlice")), at, out)
        }
        _ => out.errors.push(at.error(format!(
            "{} ({api_version}): unsupported; only {SERVICE_API_VERSION} Service and \
             {SLICE_API_VERSION} EndpointSlice are read",
            header.describe()
        ))),
    }
}

fn add_list(mut map: Mapping, item_type: Option<(&str, &str)>, at: Location<'_>, out: &mut Loaded) {
    let items = match map.remove("items") {
        None | Some(Value::Null) => return,
        Some(Value::Sequence(items)) => items,
        Some(other) => {
            out.errors.push(at.error(format!(
                "List: items must be a list, found {}",
                type_name(&other)
            )));
            return;
        }
    };
    for (index, mut item) in items.into_iter().enumerate() {
        let at = Location {
            item: Some(index + 1),
            ..at
        };
        if let (Some((api_version, kind)), Value::Mapping(fields)) = (item_type, &mut item) {
            for (key, default) in [("apiVersion", api_version), ("kind", kind)] {
                if !fields.contains_key(key) {
                    fields.insert(key.into(), default.into());
                }
            }
        }
        add_object(item, at, false, out);
    }
}

/// Deserializes a document whose kind and apiVersion have been checked, and gives it the
/// namespace the API server would.
fn typed<T>(value: Value, header: &Header, at: Location<'_>, out: &mut Loaded) -> Option<T>
where
    T: serde::de::DeserializeOwned
        + Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
{
    // Deserializing is pure, so a panic inside leaves nothing half-updated.
    let result = panic::catch_unwind(AssertUnwindSafe(|| serde_yaml::from_value::<T>(value)));
    let mut object = match result {
        Ok(Ok(object)) => object,
        Ok(Err(e)) => {
            out.errors
                .push(at.error(format!("{}: invalid: {e}", header.describe())));
            return None;
        }
        Err(_) => {
            out.errors.push(at.error(format!(
                "{}: the deserializer crashed on this object",
                header.describe()
            )));
            return None;
        }
    };
    let metadata = object.metadata_mut();
    if metadata.name.as_deref().is_none_or(str::is_empty) {
        out.errors
            .push(at.error(format!("{}: metadata.name is required", header.describe())));
        return None;
    }
    if metadata.namespace.as_deref().is_none_or(str::is_empty) {
        metadata.namespace = Some("default".to_string());
    }
    Some(object)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A scratch directory removed on drop; std has no tempdir and this is not worth a crate.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Scratch {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "svc-manifest-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn file(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn load_text(name: &str, text: &str) -> Loaded {
        let dir = Scratch::new();
        load(&dir.file(name, text))
    }

    fn names<T: Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>>(
        objects: &[Named<T>],
    ) -> Vec<String> {
        objects
            .iter()
            .map(|n| {
                let m = n.object.metadata();
                format!(
                    "{}/{}@{}",
                    m.namespace.as_deref().unwrap_or("?"),
                    m.name.as_deref().unwrap_or("?"),
                    n.doc
                )
            })
            .collect()
    }

    fn messages(loaded: &Loaded) -> Vec<String> {
        loaded.errors.iter().map(ToString::to_string).collect()
    }

    const SERVICE: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80}]
";

    const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.0.0.1]}]
";

    #[test]
    fn reads_services_and_slices_from_one_multi_document_file() {
        let loaded = load_text("all.yaml", &format!("{SERVICE}---\n{SLICE}"));
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(names(&loaded.services), ["shop/web@1"]);
        assert_eq!(names(&loaded.slices), ["shop/web-abc@2"]);
        let slice = &loaded.slices[0].object;
        assert_eq!(slice.endpoints[0].addresses, ["10.0.0.1"]);
        assert!(loaded.slices[0].origin().ends_with("all.yaml: document 2"));
    }

    #[test]
    fn missing_namespace_means_default() {
        let loaded = load_text(
            "svc.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\n",
        );
        assert_eq!(names(&loaded.services), ["default/web@1"]);
    }

    #[test]
    fn empty_documents_and_comments_are_skipped_silently() {
        let text = format!("# leading comment\n---\n---\n\n---\n# only a comment\n{SERVICE}---\n");
        let loaded = load_text("svc.yaml", &text);
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        // The leading comment belongs to the first (empty) document, not a document of its own.
        assert_eq!(names(&loaded.services), ["shop/web@3"]);
        assert!(load_text("empty.yaml", "").errors.is_empty());
    }

    #[test]
    fn a_syntax_error_costs_only_its_own_document() {
        let text = format!("{SERVICE}---\nkind: [unclosed\n---\n{SLICE}");
        let loaded = load_text("broken.yaml", &text);
        assert_eq!(names(&loaded.services), ["shop/web@1"]);
        assert_eq!(names(&loaded.slices), ["shop/web-abc@3"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("broken.yaml: document 2: invalid YAML"),
            "{errors:?}"
        );
        // The line number is the line in the file, not in the document.
        assert!(
            errors[0].contains("while parsing a flow sequence at line 8 column 7"),
            "{errors:?}"
        );
    }

    #[test]
    fn an_undefined_alias_costs_only_its_own_document() {
        // serde_yaml's own document iterator panics on the document after this one.
        let text = format!("a: *nowhere\n---\n{SERVICE}");
        let loaded = load_text("alias.yaml", &text);
        assert_eq!(names(&loaded.services), ["shop/web@2"]);
        assert_eq!(loaded.errors.len(), 1);
    }

    #[test]
    fn unknown_kinds_and_versions_are_errors_naming_the_object() {
        let text = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: api, namespace: x}\n\
                    ---\napiVersion: v1beta1\nkind: EndpointSlice\nmetadata: {name: s}\n\
                    ---\nkind: Service\nmetadata: {name: nokind}\n";
        let loaded = load_text("k.yaml", text);
        assert!(loaded.services.is_empty() && loaded.slices.is_empty());
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].contains("document 1: Deployment x/api (apps/v1): unsupported"));
        assert!(errors[1].contains("document 2: EndpointSlice default/s (v1beta1): unsupported"));
        assert!(errors[2].contains("document 3: Service default/nokind: apiVersion and kind"));
    }

    #[test]
    fn wrongly_typed_fields_are_errors_naming_the_object() {
        let text = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: bad, namespace: shop}}\n\
             spec: {{ports: [{{port: eighty}}]}}\n---\n{SERVICE}"
        );
        let loaded = load_text("t.yaml", &text);
        assert_eq!(names(&loaded.services), ["shop/web@2"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].contains("document 1: Service shop/bad: invalid:"),
            "{errors:?}"
        );
    }

    #[test]
    fn non_objects_and_nameless_objects_are_errors() {
        let text = "just a string\n---\n- a\n- list\n---\n42\n---\n\
                    apiVersion: v1\nkind: Service\nmetadata: {namespace: x}\n";
        let loaded = load_text("n.yaml", text);
        assert!(loaded.services.is_empty());
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 4, "{errors:?}");
        assert!(errors[0].contains("document 1: expected a Kubernetes object"));
        assert!(errors[1].contains("found a list"));
        assert!(
            errors[3].contains("metadata.name is required"),
            "{errors:?}"
        );
    }

    #[test]
    fn truncated_document_is_an_error_and_the_earlier_ones_survive() {
        let text = format!("{SERVICE}---\n{}", &SLICE[..SLICE.len() - 20]);
        let loaded = load_text("cut.yaml", &text);
        assert_eq!(names(&loaded.services), ["shop/web@1"]);
        assert_eq!(loaded.errors.len(), 1, "{:?}", messages(&loaded));
        assert!(messages(&loaded)[0].contains("document 2"));
    }

    #[test]
    fn lists_are_unpacked_and_bad_items_reported_by_position() {
        let text = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: cm}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: a-1}
  addressType: IPv4
  endpoints: []
- apiVersion: v1
  kind: List
  items: []
";
        let loaded = load_text("list.yaml", text);
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert_eq!(names(&loaded.slices), ["default/a-1@1"]);
        assert_eq!(loaded.slices[0].item, Some(3));
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("document 1: item 2: ConfigMap default/cm"));
        assert!(errors[1].contains("document 1: item 4: List"));
    }

    #[test]
    fn typed_lists_from_the_api_need_no_kind_on_items() {
        let text = "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: a}\n\
                    ---\napiVersion: v1\nkind: List\nitems: oops\n";
        let loaded = load_text("l.yaml", text);
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1);
        assert!(errors[0].contains("document 2: List: items must be a list"));
    }

    #[test]
    fn json_files_including_streams() {
        let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"a"}}
{"apiVersion":"v1","kind":"Service","metadata":{"name":"b"}} {"broken": "#;
        let loaded = load_text("s.json", json);
        assert_eq!(names(&loaded.services), ["default/a@1", "default/b@2"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1);
        assert!(errors[0].contains("document 3: invalid JSON"), "{errors:?}");
    }

    #[test]
    fn directories_are_read_in_name_order_skipping_other_files() {
        let dir = Scratch::new();
        dir.file(
            "b.yml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: b}\n",
        );
        dir.file(
            "a.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n",
        );
        dir.file(
            "c.JSON",
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"}}"#,
        );
        dir.file("notes.txt", "not yaml: [");
        dir.file(".a.yaml.swp", "garbage: [");
        fs::create_dir(dir.0.join("sub.yaml")).unwrap();
        let loaded = load(&dir.0);
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(
            names(&loaded.services),
            ["default/a@1", "default/b@1", "default/c@1"]
        );
    }

    #[test]
    fn missing_path_is_an_io_error() {
        let loaded = load(Path::new("/nonexistent/svc-manifests"));
        assert_eq!(loaded.errors.len(), 1);
        assert_eq!(loaded.errors[0].kind(), "io");
    }

    #[test]
    fn garbage_is_one_error_per_document_and_never_a_panic() {
        let deep = "[".repeat(10_000);
        let aliases = "a: &a [*a, *a]\n".repeat(3);
        let samples: &[&str] = &[
            "\0\0\0",
            "{{{{",
            "]]]",
            "key: value: other",
            "- - - -",
            "&a [*a]",
            "!!binary notbase64",
            "apiVersion: v1\nkind: Service\nmetadata: 7\n",
            "apiVersion: v1\nkind: Service\nmetadata: {name: [x]}\n",
            "apiVersion: 1\nkind: true\n",
            "apiVersion: v1\nkind: Service\nspec: {ports: {a: b}}\nmetadata: {name: x}\n",
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: x}\n\
             endpoints: [{addresses: 5}]\n",
            "a: 1\n...\nb: 2\n",
            "\t- tab",
            "%YAML 9.9\n---\na: 1\n",
            &deep,
            &aliases,
        ];
        for sample in samples {
            for name in ["g.yaml", "g.json"] {
                let loaded = load_text(name, sample);
                assert!(loaded.services.is_empty() && loaded.slices.is_empty());
                assert_eq!(
                    loaded.errors.len(),
                    1,
                    "{name} {sample:?}: {:?}",
                    messages(&loaded)
                );
            }
        }
        assert!(load_text("g.yaml", "---\n...\n...\n---").errors.is_empty());
        let bom = load_text(
            "g.yaml",
            "\u{feff}apiVersion: v1\nkind: Service\nmetadata: {name: bom}\n",
        );
        assert_eq!(names(&bom.services), ["default/bom@1"]);
    }

    #[test]
    fn fixture_directory_translates_end_to_end() {
        use crate::translate::{translate, NodeContext};

        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cluster");
        let loaded = load(&dir);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].ends_with(
            "10-services.yaml: document 3: Service shop/broken: invalid: \
             invalid type: string \"eighty\", expected i32"
        ));
        assert!(errors[1].contains("10-services.yaml: document 5: Deployment shop/web"));
        assert_eq!(loaded.services.len(), 3);
        assert_eq!(loaded.slices.len(), 3);

        let services: Vec<Service> = loaded.services.into_iter().map(|n| n.object).collect();
        let slices: Vec<EndpointSlice> = loaded.slices.into_iter().map(|n| n.object).collect();
        let node = NodeContext {
            node_name: Some("node-1".to_string()),
            zone: None,
            service_proxy_name: None,
        };
        let t = translate(&services, &slices, &node);
        let errors: Vec<String> = t.errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            errors,
            ["EndpointSlice kube-system/dns-1: endpoint \"10.244.300.3\" is not an IP address; skipped"]
        );
        let table: Vec<String> = t
            .state
            .frontends
            .values()
            .map(|f| {
                let backends: Vec<String> = f.backends.iter().map(ToString::to_string).collect();
                format!(
                    "{} {} {:?} [{}]",
                    f.frontend,
                    f.service,
                    f.affinity_timeout_s,
                    backends.join(" ")
                )
            })
            .collect();
        assert_eq!(
            table,
            [
                "10.96.0.10:53/TCP kube-system/dns:dns-tcp Some(10800) [10.244.1.2:53]",
                "10.96.0.10:53/UDP kube-system/dns:dns Some(10800) [10.244.1.2:53]",
                "10.96.10.1:80/TCP shop/web:http None [10.244.1.5:8080 10.244.2.9:9090]",
                "10.96.10.1:443/TCP shop/web:https None [10.244.1.5:8443 10.244.2.9:8443]",
            ]
        );
    }

    #[test]
    fn document_markers_are_recognised_only_at_line_start() {
        let chunks = split_documents("a: '---'\n  ---\n---x: 1\n--- \nb: 1\n---\r\nc: 1\n");
        let starts: Vec<usize> = chunks.iter().map(|c| c.first_line).collect();
        assert_eq!(starts, [0, 3, 5]);
    }
}
