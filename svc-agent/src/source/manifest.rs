//! Services and EndpointSlices from YAML manifest files.
//!
//! The loader is deliberately forgiving: every problem becomes an [`Error`] that names the
//! file, the document and (where known) the object, and loading carries on with the next
//! document. A typo in one Service must never take the other Services down with it, and a
//! file that cannot be read keeps serving what it held when it last could.
//!
//! Every input is bounded: file and document sizes, document count, nesting depth and alias
//! expansion all have limits, so a hostile or broken file costs time in proportion to its
//! (capped) size and is rejected at the first limit it crosses.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::Metadata;
use serde_json::{Map, Value};
use serde_saphyr::granit_parser::{self, Event, Parser};
use tracing::{debug, instrument};

use crate::error::{Error, Result};
use crate::translate::{
    parse_service, parse_slice, Keyed, NodeContext, ParsedService, ParsedSlice,
};

/// A loaded object and where it came from, so later errors can point back at the file.
#[derive(Clone, Debug, PartialEq)]
pub struct Named<T> {
    pub object: T,
    /// Shared by every object of a file.
    pub path: Arc<Path>,
    /// Position of the document in its file, counting from 1.
    pub doc: usize,
    /// Position inside a `kind: List` document, counting from 1.
    pub item: Option<usize>,
    /// The load of its [`ManifestSource`] since which its file has defined this object
    /// without a break (0 outside one): of two definitions of one object, the older is the
    /// one that serves, so a file added later never takes an object over.
    pub since: u64,
}

impl<T> Named<T> {
    /// The same origin for another reading of the object.
    pub fn with<U>(&self, object: U) -> Named<U> {
        Named {
            object,
            path: self.path.clone(),
            doc: self.doc,
            item: self.item,
            since: self.since,
        }
    }

    /// "path: document N" or "path: document N, item M", for log lines (a file name can
    /// hold a newline, so it is escaped).
    pub fn origin(&self) -> String {
        let path = self.path.display().to_string();
        let path = crate::names::escape(&path);
        match self.item {
            Some(item) => format!("{path}: document {}, item {item}", self.doc),
            None => format!("{path}: document {}", self.doc),
        }
    }
}

/// What a [`ManifestSource`] serves now: every file's objects as of its last successful read,
/// and what went wrong in this read.
pub struct Parsed<'a> {
    pub services: Vec<&'a Named<ParsedService>>,
    pub slices: Vec<&'a Named<ParsedSlice>>,
    pub errors: Vec<Error>,
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

/// Bounds on what one load may cost. Parsing is linear in the input, so capping sizes caps
/// time; depth and alias limits stop the inputs that are small but expensive.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// One file; larger files are not read.
    file_bytes: u64,
    /// All files of one load together.
    total_bytes: u64,
    /// One YAML document: above the API server's own limit for an object (1.5 MiB), so
    /// anything a cluster can hold fits, with room for moderate `kind: List` documents.
    document_bytes: usize,
    /// Documents in one file; the rest of the file is ignored.
    documents: usize,
    /// Nesting of mappings and sequences. Kubernetes objects, managedFields included, stay
    /// well below it.
    depth: usize,
    /// Nodes copied by alias expansion in one document (the "billion laughs").
    alias_replays: usize,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        file_bytes: 8 << 20,
        // A directory can hold a cluster's worth of objects (100,000 Services with their
        // slices is about 60 MiB of JSON); the per-file limits bound what one bad file costs.
        total_bytes: 512 << 20,
        document_bytes: 2 << 20,
        documents: 10_000,
        depth: 64,
        alias_replays: 10_000,
    };
}

/// The manifests under one path, read again on demand. Remembers what each file contributed
/// at its last successful read, so a file that cannot be read for a while (an I/O error, a
/// symlink loop, a permission change) keeps its objects instead of withdrawing its Services.
#[derive(Debug)]
pub struct ManifestSource {
    path: PathBuf,
    /// Whether `path` was a directory when opened. It stays what it was: a directory that
    /// later turns into a file (or the reverse) is an error, not a new meaning of the flag.
    dir: bool,
    /// The objects of each file at its last successful read, by path (so in name order).
    files: BTreeMap<PathBuf, FileObjects>,
    fingerprint: Option<Fingerprint>,
    limits: Limits,
    /// Loads so far; see [`Named::since`].
    loads: u64,
}

/// What one file contributed, kept parsed: the rules' compact reading of each object rather
/// than the API object, which is many times larger (100,000 Services with their slices would
/// otherwise hold gigabytes).
#[derive(Default)]
struct FileObjects {
    services: Vec<Named<ParsedService>>,
    slices: Vec<Named<ParsedSlice>>,
    /// The file as it was read (size, inode, change times): while it stays so, the objects
    /// above are still what it says, and it is not parsed again.
    read_as: Option<(u64, u64, i64, i64, i64, i64)>,
}

fn read_as(meta: &fs::Metadata) -> (u64, u64, i64, i64, i64, i64) {
    (
        meta.len(),
        meta.ino(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
    )
}

impl std::fmt::Debug for FileObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileObjects")
            .field("services", &self.services.len())
            .field("slices", &self.slices.len())
            .field("read_as", &self.read_as)
            .finish()
    }
}

impl FileObjects {
    fn len(&self) -> usize {
        self.services.len() + self.slices.len()
    }
}

/// A cheap summary of the manifest files: names, types, sizes, inodes and modification
/// times, or why they could not be looked at. Editors and `kubectl`-style tools replace
/// files by rename, which changes the inode; ConfigMap volumes re-point a symlink, which the
/// followed metadata shows.
type Fingerprint = std::result::Result<Vec<(PathBuf, Stamp)>, io::ErrorKind>;
type Stamp = std::result::Result<(bool, u64, u64, Option<SystemTime>), io::ErrorKind>;

fn stamp(path: &Path) -> Stamp {
    fs::metadata(path)
        .map(|m| (m.is_file(), m.len(), m.ino(), m.modified().ok()))
        .map_err(|e| e.kind())
}

impl ManifestSource {
    /// Opens `path`, a manifest file or a directory of them. A path that does not exist or
    /// cannot be read at all is an error: serving nothing because of a typo in a flag would
    /// look like a healthy agent with no Services.
    pub fn open(path: &Path) -> Result<ManifestSource> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = fs::metadata(path).map_err(io)?;
        if meta.is_dir() {
            fs::read_dir(path).map_err(io)?;
        } else {
            open_regular(path).map_err(io)?;
        }
        Ok(ManifestSource::new(path, meta.is_dir()))
    }

    fn new(path: &Path, dir: bool) -> ManifestSource {
        ManifestSource {
            path: path.to_path_buf(),
            dir,
            files: BTreeMap::new(),
            fingerprint: None,
            limits: Limits::DEFAULT,
            loads: 0,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the files may have changed since the last call (always true on the first).
    /// Costs a directory listing and a stat per manifest file.
    pub fn changed(&mut self) -> bool {
        let now = self.fingerprint();
        let changed = self.fingerprint.as_ref() != Some(&now);
        self.fingerprint = Some(now);
        changed
    }

    fn fingerprint(&self) -> Fingerprint {
        if !self.dir {
            return Ok(vec![(self.path.clone(), stamp(&self.path))]);
        }
        let mut files: Vec<(PathBuf, Stamp)> = fs::read_dir(&self.path)
            .map_err(|e| e.kind())?
            .flatten()
            .filter(|entry| is_manifest_name(&entry.file_name().to_string_lossy()))
            .map(|entry| {
                let path = entry.path();
                let stamp = stamp(&path);
                (path, stamp)
            })
            .collect();
        files.sort();
        Ok(files)
    }

    /// Reads every manifest file again. Files that cannot be read contribute what they held
    /// at their last successful read; files no longer in the directory contribute nothing.
    /// Never fails as a whole; see [`Loaded::errors`].
    #[instrument(skip_all, fields(path = %self.path.display()))]
    pub fn load(&mut self) -> Parsed<'_> {
        self.loads += 1;
        let mut errors = Vec::new();
        let mut budget = self.limits.total_bytes;
        if self.dir {
            match self.list() {
                Ok(listed) => {
                    // Whatever is no longer listed was deleted or renamed away.
                    self.files.retain(|path, _| listed.contains_key(path));
                    for (path, meta) in listed {
                        self.read_entry(path, meta, &mut budget, &mut errors);
                    }
                }
                Err(source) => errors.push(self.kept(&self.path, source, None)),
            }
        } else {
            let path = self.path.clone();
            self.read_file(path, &mut budget, &mut errors);
        }
        let mut out = Parsed {
            services: Vec::new(),
            slices: Vec::new(),
            errors,
        };
        for objects in self.files.values() {
            out.services.extend(objects.services.iter());
            out.slices.extend(objects.slices.iter());
        }
        debug!(
            services = out.services.len(),
            slices = out.slices.len(),
            errors = out.errors.len(),
            "manifests loaded"
        );
        out
    }

    /// The manifest files directly inside the directory, by name, with their (followed)
    /// metadata or why it could not be had.
    fn list(&self) -> io::Result<BTreeMap<PathBuf, io::Result<fs::Metadata>>> {
        let meta = fs::metadata(&self.path)?;
        if !meta.is_dir() {
            return Err(io::Error::from(io::ErrorKind::NotADirectory));
        }
        let mut listed = BTreeMap::new();
        for entry in fs::read_dir(&self.path)? {
            let entry = entry?;
            // Hidden files are editor backups and the like; a ConfigMap volume's `..data`
            // machinery is hidden too, and its files are reachable through the visible
            // symlinks, which fs::metadata follows.
            if !is_manifest_name(&entry.file_name().to_string_lossy()) {
                continue;
            }
            let path = entry.path();
            let meta = fs::metadata(&path);
            // Gone between the listing and the stat: as if it had not been listed.
            if meta.is_err() && fs::symlink_metadata(&path).is_err_and(is_not_found) {
                continue;
            }
            listed.insert(path, meta);
        }
        Ok(listed)
    }

    fn read_entry(
        &mut self,
        path: PathBuf,
        meta: io::Result<fs::Metadata>,
        budget: &mut u64,
        errors: &mut Vec<Error>,
    ) {
        match meta {
            Ok(meta) if meta.is_file() => {
                if let Some(f) = self.files.get(&path) {
                    if f.read_as == Some(read_as(&meta)) {
                        *budget = budget.saturating_sub(meta.len());
                        return;
                    }
                }
                self.read_file(path, budget, errors)
            }
            // A directory or a device with a manifest's name is not a manifest, unless it
            // used to be one: then the file became unreadable, and that is worth saying.
            Ok(meta) => {
                if self.files.contains_key(&path) {
                    let kind = if meta.is_dir() {
                        io::ErrorKind::IsADirectory
                    } else {
                        io::ErrorKind::InvalidInput
                    };
                    let source = io::Error::new(kind, "no longer a regular file");
                    errors.push(self.kept(&path, source, None));
                }
            }
            Err(source) => errors.push(self.kept(&path, source, None)),
        }
    }

    fn read_file(&mut self, path: PathBuf, budget: &mut u64, errors: &mut Vec<Error>) {
        let cap = self.limits.file_bytes.min(*budget);
        let bytes = match read_capped(&path, cap) {
            Ok(bytes) => bytes,
            Err(source) => {
                let why = (source.kind() == io::ErrorKind::FileTooLarge).then(|| {
                    let file_bytes = self.limits.file_bytes;
                    if fs::metadata(&path).is_ok_and(|m| m.len() > file_bytes) {
                        format!("larger than {}", size(file_bytes))
                    } else {
                        format!(
                            "the manifests exceed {} in total",
                            size(self.limits.total_bytes)
                        )
                    }
                });
                errors.push(self.kept(&path, source, why));
                return;
            }
        };
        *budget -= bytes.len() as u64;
        // Taken before reading would be safer against a write in between, but a rewrite
        // changes the change time again, so the next look reads it anyway.
        let stamp = fs::metadata(&path).ok().map(|m| read_as(&m));
        let mut out = Loaded::default();
        parse_file(&path, &bytes, &self.limits, &mut out);
        debug!(
            file = %crate::names::Escaped(&path.display().to_string()),
            services = out.services.len(),
            slices = out.slices.len(),
            errors = out.errors.len(),
            "file read"
        );
        errors.append(&mut out.errors);
        // Parsed here, one file at a time, so no more than one file's API objects are ever
        // held at once. kube-proxy's own label selection applies as with the API.
        let node = NodeContext::default();
        let file: Arc<Path> = Arc::from(path.as_path());
        // What this file defined before keeps its age: an edit is no new definition.
        let before = self.files.remove(&path).unwrap_or_default();
        let now = self.loads;
        let services = parse_kept(
            out.services,
            &before.services,
            &file,
            now,
            errors,
            |o, e| parse_service(o, &node, e),
        );
        let slices = parse_kept(out.slices, &before.slices, &file, now, errors, |o, e| {
            parse_slice(o, &node, e)
        });
        drop(before);
        self.files.insert(
            path,
            FileObjects {
                services,
                slices,
                read_as: stamp,
            },
        );
    }

    /// The error for a file (or the directory) that could not be read; its objects, if it
    /// had any, stay as they were, and the message says so.
    fn kept(&self, path: &Path, source: io::Error, why: Option<String>) -> Error {
        let kept = if path == self.path {
            self.files.values().map(FileObjects::len).sum()
        } else {
            self.files.get(path).map_or(0, FileObjects::len)
        };
        let mut message = why.unwrap_or_else(|| source.to_string());
        if kept > 0 {
            message.push_str(&format!(
                "; keeping the objects of the last successful read ({kept})"
            ));
        }
        Error::Io {
            path: path.to_path_buf(),
            source: io::Error::new(source.kind(), message),
        }
    }
}

/// One file's API objects of one kind, parsed (into new vectors, not in place: that would
/// keep the API objects' much larger allocation alive under the small parsed ones), each
/// keeping its age from `before`, what the file defined before (an edit is no new
/// definition); what parsing found goes to `errors`, naming where each object came from.
fn parse_kept<A, P: Keyed>(
    objects: Vec<Named<A>>,
    before: &[Named<P>],
    file: &Arc<Path>,
    now: u64,
    errors: &mut Vec<Error>,
    parse: impl Fn(&A, &mut Vec<Error>) -> Option<P>,
) -> Vec<Named<P>> {
    let since = since_of(before);
    let mut found = Vec::new();
    let mut parsed = Vec::with_capacity(objects.len());
    parsed.extend(objects.into_iter().filter_map(|n| {
        let p = parse(&n.object, &mut found);
        name_origin(&mut found, &n, errors);
        p.map(|p| Named {
            since: since(&p).unwrap_or(now),
            object: p,
            path: file.clone(),
            doc: n.doc,
            item: n.item,
        })
    }));
    parsed
}

/// Since when each object of `objects` (one file's, of one kind) has been defined there.
fn since_of<T: Keyed>(objects: &[Named<T>]) -> impl Fn(&T) -> Option<u64> + '_ {
    let by_key: std::collections::HashMap<(&str, &str), u64> = objects
        .iter()
        .map(|n| ((n.object.namespace(), n.object.name()), n.since))
        .collect();
    move |o: &T| by_key.get(&(o.namespace(), o.name())).copied()
}

/// Moves the errors parsing found in `n` to `errors`, each naming where `n` came from.
fn name_origin<T>(found: &mut Vec<Error>, n: &Named<T>, errors: &mut Vec<Error>) {
    for e in found.drain(..) {
        errors.push(match e {
            Error::Invalid { object, message } => Error::Invalid {
                object: format!("{object} ({})", n.origin()),
                message,
            },
            other => other,
        });
    }
}

/// Reads Services and EndpointSlices from `path` once, as API objects: one file with any
/// number of YAML documents (or a JSON file), or a directory whose `*.yaml`, `*.yml` and
/// `*.json` files are read in name order. Never fails as a whole; see [`Loaded::errors`].
pub fn load(path: &Path) -> Loaded {
    let source = ManifestSource::new(path, fs::metadata(path).is_ok_and(|m| m.is_dir()));
    let mut out = Loaded::default();
    let files: Vec<PathBuf> = if source.dir {
        match source.list() {
            Ok(listed) => listed
                .into_iter()
                .filter_map(|(p, meta)| match meta {
                    Ok(m) if m.is_file() => Some(p),
                    Ok(_) => None,
                    Err(e) => {
                        out.errors.push(Error::Io { path: p, source: e });
                        None
                    }
                })
                .collect(),
            Err(e) => {
                out.errors.push(Error::Io {
                    path: path.to_path_buf(),
                    source: e,
                });
                Vec::new()
            }
        }
    } else {
        vec![path.to_path_buf()]
    };
    let mut budget = source.limits.total_bytes;
    for file in files {
        match read_capped(&file, source.limits.file_bytes.min(budget)) {
            Ok(bytes) => {
                budget -= bytes.len() as u64;
                parse_file(&file, &bytes, &source.limits, &mut out);
            }
            Err(e) => out.errors.push(Error::Io {
                path: file,
                source: e,
            }),
        }
    }
    out
}

fn is_not_found(e: io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
}

fn size(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

fn is_manifest_name(name: &str) -> bool {
    !name.starts_with('.')
        && Path::new(name)
            .extension()
            .and_then(|ext| ext.to_str())
            .is_some_and(|ext| {
                ["yaml", "yml", "json"]
                    .iter()
                    .any(|want| ext.eq_ignore_ascii_case(want))
            })
}

/// Opens a file for reading without blocking: a FIFO put in place of a manifest must not
/// hang the agent in open(), and must not be read either.
fn open_regular(path: &Path) -> io::Result<File> {
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Err(io::Error::from_raw_os_error(libc::EISDIR));
    }
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// The whole file, or `FileTooLarge` if it holds more than `cap` bytes (checked on what is
/// read, not on the size reported before, which may change meanwhile).
fn read_capped(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(io::Error::from(io::ErrorKind::FileTooLarge));
    }
    Ok(bytes)
}

fn is_json(path: &Path) -> bool {
    path.extension()
        .and_then(|ext| ext.to_str())
        .is_some_and(|ext| ext.eq_ignore_ascii_case("json"))
}

fn parse_file(path: &Path, bytes: &[u8], limits: &Limits, out: &mut Loaded) {
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let line = bytes[..e.valid_up_to()]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1;
            out.errors.push(Error::Io {
                path: path.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("not UTF-8 text (line {line})"),
                ),
            });
            return;
        }
    };
    if is_json(path) {
        load_json(path, text, limits, out);
    } else {
        load_yaml(path, text, limits, out);
    }
}

fn load_json(path: &Path, text: &str, limits: &Limits, out: &mut Loaded) {
    // kubectl accepts a stream of concatenated JSON objects, so we do too. serde_json
    // refuses nesting beyond 128 levels on its own.
    let stream = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    for (index, value) in stream.enumerate() {
        let doc = index + 1;
        if doc > limits.documents {
            out.errors
                .push(manifest_error(path, doc, too_many_documents(limits)));
            return;
        }
        match value {
            Ok(value) => add_document(value, path, doc, out),
            Err(e) => {
                // A JSON syntax error leaves no reliable place to resume from.
                out.errors
                    .push(manifest_error(path, doc, format!("invalid JSON: {e}")));
                return;
            }
        }
    }
}

fn too_many_documents(limits: &Limits) -> String {
    format!(
        "more than {} documents in one file; the rest of the file is ignored",
        limits.documents
    )
}

fn too_large_document(limits: &Limits) -> String {
    format!(
        "document larger than {}",
        size(limits.document_bytes as u64)
    )
}

fn manifest_error(path: &Path, doc: usize, message: String) -> Error {
    Error::Manifest {
        path: path.to_path_buf(),
        doc,
        message,
    }
}

/// One YAML document of a file: where its text is, or why it has none.
#[derive(Debug, PartialEq)]
enum Document {
    /// `text[start..end]` holds the document alone; `line` is the file's line it starts on,
    /// counting from 1.
    Text {
        start: usize,
        end: usize,
        line: usize,
    },
    Invalid(String),
}

/// Finds the documents of a YAML stream with the parser's own event stream, which knows
/// exactly where each one starts and ends (a `---` inside a block scalar, a `...` end marker,
/// directives). After a syntax error the parser resumes at the next document marker, so one
/// broken document costs only itself.
fn split_documents(text: &str, limits: &Limits) -> Vec<Document> {
    let mut options = granit_parser::Options::default();
    // Only the document boundaries are wanted here.
    options.set_emit_comments(false);
    options.flow_nesting_limit = limits.depth;
    options.block_nesting_limit = limits.depth;
    let mut parser = Parser::new_from_str_with_options(text, options);
    let mut docs = Vec::new();
    // Where the next document's text begins: just after the previous one, so comments and
    // directives in between go with the document they precede. Unknown after an error.
    let mut next_start: Option<(usize, usize)> = Some((0, 1));
    let mut current: Option<(usize, usize)> = None;
    loop {
        let failure = match parser.next_event() {
            None | Some(Ok((Event::StreamEnd, _))) => break,
            Some(Ok((Event::DocumentStart(..), span))) => {
                if docs.len() == limits.documents {
                    docs.push(Document::Invalid(too_many_documents(limits)));
                    break;
                }
                let Some(at) = span.start.byte_offset() else {
                    docs.push(Document::Invalid("the parser lost its position".into()));
                    break;
                };
                current = Some(
                    next_start
                        .filter(|&(start, _)| start <= at)
                        .unwrap_or((at, span.start.line())),
                );
                continue;
            }
            Some(Ok((Event::DocumentEnd, span))) => {
                let (Some((start, line)), Some(end)) = (current.take(), span.end.byte_offset())
                else {
                    docs.push(Document::Invalid("the parser lost its position".into()));
                    break;
                };
                // Trailing comments are no events, so the end is where size is sure.
                docs.push(if end.saturating_sub(start) > limits.document_bytes {
                    Document::Invalid(too_large_document(limits))
                } else {
                    Document::Text { start, end, line }
                });
                next_start = Some((end, span.end.line()));
                continue;
            }
            Some(Ok((_, span))) => {
                let (Some((start, _)), Some(at)) = (current, span.end.byte_offset()) else {
                    continue;
                };
                if at.saturating_sub(start) <= limits.document_bytes {
                    continue;
                }
                too_large_document(limits)
            }
            Some(Err(e)) => format!(
                "invalid YAML: {} at line {}, column {}",
                e.info(),
                e.marker().line(),
                e.marker().col() + 1
            ),
        };
        // The failure belongs to the open document, or starts one if it came before any
        // (a bad directive, say).
        if current.take().is_none() && docs.len() == limits.documents {
            docs.push(Document::Invalid(too_many_documents(limits)));
            break;
        }
        docs.push(Document::Invalid(failure));
        next_start = None;
        match parser.proceed_next_document() {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                docs.push(Document::Invalid(format!("invalid YAML: {}", e.info())));
                break;
            }
        }
    }
    docs
}

fn load_yaml(path: &Path, text: &str, limits: &Limits, out: &mut Loaded) {
    let options = serde_saphyr::options! {
        // Text has at most about a node per byte, so for nodes and events the size limit
        // binds (a long List must not fail on a count), and the alias limit beyond it.
        budget: serde_saphyr::budget! {
            max_depth: limits.depth,
            flow_nesting_limit: limits.depth,
            max_total_scalar_bytes: limits.document_bytes,
            max_nodes: limits.document_bytes,
            max_events: 2 * limits.document_bytes,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: limits.alias_replays,
        },
        // YAML 1.2 booleans only: a name or label value such as `y` or `on` stays a string.
        strict_booleans: true,
        // Messages must fit on one log line.
        with_snippet: false,
    };
    for (index, document) in split_documents(text, limits).into_iter().enumerate() {
        let doc = index + 1;
        let (start, end, line) = match document {
            Document::Text { start, end, line } => (start, end, line),
            Document::Invalid(message) => {
                out.errors.push(manifest_error(path, doc, message));
                continue;
            }
        };
        let Some(chunk) = text.get(start..end) else {
            out.errors.push(manifest_error(
                path,
                doc,
                "the parser lost its position".into(),
            ));
            continue;
        };
        match serde_saphyr::from_str_with_options::<Value>(chunk, options.clone()) {
            Ok(value) => add_document(value, path, doc, out),
            Err(e) => {
                let message = e.render_with_options(serde_saphyr::render_options! {
                    line_offset: line.saturating_sub(1) as u64,
                });
                out.errors.push(manifest_error(
                    path,
                    doc,
                    format!("invalid YAML: {message}"),
                ));
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
    fn of(map: &Map<String, Value>) -> Header {
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
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
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
            path: Arc::from(self.path),
            doc: self.doc,
            item: self.item,
            since: 0,
        }
    }
}

fn add_object(value: Value, at: Location<'_>, lists_allowed: bool, out: &mut Loaded) {
    let Value::Object(map) = value else {
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
            if let Some(service) = typed::<Service>(Value::Object(map), &header, at, out) {
                out.services.push(at.named(service));
            }
        }
        (SLICE_API_VERSION, "EndpointSlice") => {
            if let Some(slice) = typed::<EndpointSlice>(Value::Object(map), &header, at, out) {
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

fn add_list(
    mut map: Map<String, Value>,
    item_type: Option<(&str, &str)>,
    at: Location<'_>,
    out: &mut Loaded,
) {
    let items = match map.remove("items") {
        None | Some(Value::Null) => return,
        Some(Value::Array(items)) => items,
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
        if let (Some((api_version, kind)), Value::Object(fields)) = (item_type, &mut item) {
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
    let mut object = match serde_json::from_value::<T>(value) {
        Ok(object) => object,
        Err(e) => {
            out.errors
                .push(at.error(format!("{}: invalid: {e}", header.describe())));
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

    /// "namespace/name@document" of a loaded object, API object or parsed.
    trait ObjName {
        fn obj_name(&self) -> String;
    }

    impl<T: Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>> ObjName
        for Named<T>
    {
        fn obj_name(&self) -> String {
            let m = self.object.metadata();
            format!(
                "{}/{}@{}",
                m.namespace.as_deref().unwrap_or("?"),
                m.name.as_deref().unwrap_or("?"),
                self.doc
            )
        }
    }

    impl<T: crate::translate::Keyed> ObjName for &Named<T> {
        fn obj_name(&self) -> String {
            format!(
                "{}/{}@{}",
                self.object.namespace(),
                self.object.name(),
                self.doc
            )
        }
    }

    fn names<N: ObjName>(objects: &[N]) -> Vec<String> {
        objects.iter().map(ObjName::obj_name).collect()
    }

    trait Errs {
        fn errs(&self) -> &[Error];
    }

    impl Errs for Loaded {
        fn errs(&self) -> &[Error] {
            &self.errors
        }
    }

    impl Errs for Parsed<'_> {
        fn errs(&self) -> &[Error] {
            &self.errors
        }
    }

    fn messages(loaded: &impl Errs) -> Vec<String> {
        loaded.errs().iter().map(ToString::to_string).collect()
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
            errors[0].ends_with("unclosed bracket '[' at line 8, column 7"),
            "{errors:?}"
        );
    }

    #[test]
    fn an_undefined_alias_costs_only_its_own_document() {
        // The parser refuses it, and resumes at the next document.
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
        // `...` ends a document and a bare one may follow: two documents, two errors.
        let ended = messages(&load_text("g.yaml", "a: 1\n...\nb: 2\n"));
        assert_eq!(ended.len(), 2, "{ended:?}");
        assert!(
            ended[1].contains("document 2: object (unnamed)"),
            "{ended:?}"
        );
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
            node_ips: Vec::new(),
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
    fn document_markers_are_recognised_only_at_line_start_outside_scalars() {
        // `---` in a quoted or block scalar, or glued to a key, starts nothing; `--- ` and a
        // CRLF marker do.
        let text = "a: '---'\nb: |\n  ---\n---x: 1\n--- \nc: 1\n---\r\nd: 1\n";
        let starts: Vec<usize> = split_documents(text, &Limits::DEFAULT)
            .iter()
            .map(|d| match d {
                Document::Text { line, .. } => *line,
                Document::Invalid(e) => panic!("{e}"),
            })
            .collect();
        assert_eq!(starts, [1, 5, 7]);
        let loaded = load_text("m.yaml", text);
        assert_eq!(loaded.errors.len(), 3, "{:?}", messages(&loaded));
        assert!(messages(&loaded)[0].contains("document 1: object (unnamed): apiVersion"));
    }

    /// A Service the agent would serve (a source keeps only those).
    fn service_named(name: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\n\
             spec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
        )
    }

    fn source(path: &Path) -> ManifestSource {
        ManifestSource::open(path).expect("manifests open")
    }

    fn small(path: &Path, limits: Limits) -> ManifestSource {
        ManifestSource {
            limits,
            ..source(path)
        }
    }

    /// Replaces `path` (a file or symlink) by a symlink pointing at itself.
    fn make_loop(path: &Path) {
        fs::remove_file(path).unwrap();
        std::os::unix::fs::symlink(path.file_name().unwrap(), path).unwrap();
    }

    // The work is bounded by where the parser stops, not by the size of the input: it gives
    // up at the first bracket past the depth limit. The time is logged, never asserted.
    #[test]
    fn deep_nesting_is_refused_at_the_depth_limit_and_costs_only_its_document() {
        let deep = "[".repeat(400_000);
        let blocks: String = (0..200).map(|i| format!("{}a:\n", " ".repeat(i))).collect();
        for (name, text, message) in [
            (
                "brackets.yaml",
                format!("{deep}\n---\n{SERVICE}"),
                "document 1: invalid YAML: recursion limit exceeded at line 1, column 65",
            ),
            (
                "blocks.yaml",
                format!("{blocks}---\n{SERVICE}"),
                "document 1: invalid YAML: recursion limit exceeded at line 65, column 65",
            ),
        ] {
            let started = std::time::Instant::now();
            let loaded = load_text(name, &text);
            eprintln!("{name}: {} bytes in {:?}", text.len(), started.elapsed());
            let errors = messages(&loaded);
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(errors[0].ends_with(message), "{errors:?}");
            assert_eq!(names(&loaded.services), ["shop/web@2"]);
        }
        let started = std::time::Instant::now();
        let loaded = load_text("deep.json", &deep);
        eprintln!("deep.json: {} bytes in {:?}", deep.len(), started.elapsed());
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains(
                "document 1: invalid JSON: recursion limit exceeded at line 1 column 128"
            ),
            "{errors:?}"
        );
    }

    #[test]
    fn alias_expansion_is_bounded() {
        // Ten to the power of twenty copies of "x" if expanded in full.
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..=20 {
            let p = i - 1;
            bomb.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        let text = format!("{bomb}---\n{SERVICE}");
        let started = std::time::Instant::now();
        let loaded = load_text("bomb.yaml", &text);
        eprintln!("bomb.yaml: {:?}", started.elapsed());
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("document 1: invalid YAML: alias replay limit exceeded"),
            "{errors:?}"
        );
        assert_eq!(names(&loaded.services), ["shop/web@2"]);
        // A few aliases, as people write them, are fine.
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a, labels: &l {app: a}}\n\
                    spec: {selector: *l}\n";
        let loaded = load_text("alias.yaml", text);
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        let spec = loaded.services[0].object.spec.as_ref().unwrap();
        assert_eq!(spec.selector.as_ref().unwrap()["app"], "a");
    }

    #[test]
    fn documents_files_and_loads_have_size_limits() {
        let dir = Scratch::new();
        let limits = Limits {
            document_bytes: 1000,
            file_bytes: 4000,
            // a.yaml and c.yaml fit, d.json no longer does.
            total_bytes: 1900,
            documents: 3,
            ..Limits::DEFAULT
        };
        let padding = format!("  annotations: {{note: '{}'}}\n", "x".repeat(1000));
        let big = format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: big\n{padding}");
        dir.file(
            "a.yaml",
            &format!(
                "{}---\n{big}---\n{}",
                service_named("a1"),
                service_named("a2")
            ),
        );
        dir.file(
            "b.yaml",
            &format!("{}\n#{}\n", service_named("b"), "x".repeat(4000)),
        );
        let mut docs = String::new();
        for i in 1..=5 {
            docs.push_str(&format!("---\n{}", service_named(&format!("c{i}"))));
        }
        dir.file("c.yaml", &docs);
        let json: String = (1..=5)
            .map(|i| {
                format!(r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"j{i}"}},"spec":{{"clusterIP":"10.96.0.1","ports":[{{"port":80}}]}}}}"#)
            })
            .collect();
        dir.file("d.json", &json);
        let mut source = small(&dir.0, limits);
        let loaded = source.load();
        let errors = messages(&loaded);
        assert_eq!(
            names(&loaded.services),
            [
                "default/a1@1",
                "default/a2@3",
                "default/c1@1",
                "default/c2@2",
                "default/c3@3"
            ]
        );
        assert_eq!(errors.len(), 4, "{errors:?}");
        assert!(errors[0].ends_with("a.yaml: document 2: document larger than 1000 bytes"));
        assert!(
            errors[1].ends_with("b.yaml: larger than 4000 bytes"),
            "{errors:?}"
        );
        assert!(errors[2].ends_with(
            "c.yaml: document 4: more than 3 documents in one file; the rest of the file is ignored"
        ));
        assert!(errors[3].ends_with("d.json: the manifests exceed 1900 bytes in total"));
        // Comments count towards a document's size too.
        let text = format!("a: 1\n#{}\n---\nb: 1\n", "x".repeat(2000));
        let docs = split_documents(&text, &limits);
        assert_eq!(docs[0], Document::Invalid(too_large_document(&limits)));
        assert!(
            matches!(docs[1], Document::Text { line: 3, .. }),
            "{docs:?}"
        );
    }

    #[test]
    fn json_streams_have_a_document_limit_too() {
        let dir = Scratch::new();
        let json: String = (1..=5)
            .map(|i| {
                format!(r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"j{i}"}},"spec":{{"clusterIP":"10.96.0.1","ports":[{{"port":80}}]}}}}"#)
            })
            .collect();
        let file = dir.file("d.json", &json);
        let mut source = small(
            &file,
            Limits {
                documents: 2,
                ..Limits::DEFAULT
            },
        );
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/j1@1", "default/j2@2"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("d.json: document 3: more than 2 documents"));
    }

    #[test]
    fn text_that_is_not_utf8_is_named() {
        let dir = Scratch::new();
        let path = dir.0.join("bin.yaml");
        fs::write(
            &path,
            b"apiVersion: v1\nkind: Service\nmetadata: {name: \xff}\n",
        )
        .unwrap();
        let loaded = load(&path);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].ends_with("bin.yaml: not UTF-8 text (line 3)"),
            "{errors:?}"
        );
    }

    #[test]
    fn opening_a_missing_or_looping_path_fails_naming_it() {
        let dir = Scratch::new();
        let missing = dir.0.join("nowhere");
        let e = ManifestSource::open(&missing).unwrap_err().to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        assert!(e.contains("No such file or directory"), "{e}");
        let looped = dir.file("loop.yaml", "");
        make_loop(&looped);
        let e = ManifestSource::open(&looped).unwrap_err().to_string();
        assert!(
            e.contains("loop.yaml") && e.contains("symbolic links"),
            "{e}"
        );
        assert!(ManifestSource::open(&dir.0).is_ok());
        assert!(ManifestSource::open(&dir.file("a.yaml", "")).is_ok());
    }

    #[test]
    fn an_unreadable_file_keeps_its_last_good_objects_until_it_is_gone() {
        let dir = Scratch::new();
        dir.file("a.yaml", &service_named("a"));
        let b = dir.file("b.yaml", &format!("{}---\n{SLICE}", service_named("b")));
        let mut source = source(&dir.0);
        let loaded = source.load();
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(names(&loaded.services), ["default/a@1", "default/b@1"]);

        // A symlink loop, then a directory, where b.yaml was.
        make_loop(&b);
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1", "default/b@1"]);
        assert_eq!(names(&loaded.slices), ["shop/web-abc@2"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].ends_with(
                "b.yaml: Too many levels of symbolic links (os error 40); \
                 keeping the objects of the last successful read (2)"
            ),
            "{errors:?}"
        );
        assert_eq!(loaded.errors[0].kind(), "io");
        fs::remove_file(&b).unwrap();
        fs::create_dir(&b).unwrap();
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1", "default/b@1"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("b.yaml: no longer a regular file; keeping"));

        // Readable again, with new contents: they replace the kept ones.
        fs::remove_dir(&b).unwrap();
        dir.file("b.yaml", &service_named("b2"));
        let loaded = source.load();
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(names(&loaded.services), ["default/a@1", "default/b2@1"]);
        assert!(loaded.slices.is_empty());

        // Bad contents are not an I/O error: what the file now says is what counts.
        dir.file("b.yaml", "kind: [unclosed\n");
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert_eq!(loaded.errors.len(), 1);

        // Deleted: its objects go, silently.
        dir.file("b.yaml", &service_named("b"));
        source.load();
        fs::remove_file(&b).unwrap();
        let loaded = source.load();
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(names(&loaded.services), ["default/a@1"]);
    }

    #[test]
    fn a_fifo_is_never_opened_for_reading() {
        let dir = Scratch::new();
        let a = dir.file("a.yaml", &service_named("a"));
        let fifo = |path: &Path| {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        };
        fifo(&dir.0.join("never.yaml"));
        let mut source = source(&dir.0);
        let loaded = source.load();
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        fs::remove_file(&a).unwrap();
        fifo(&a);
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert!(messages(&loaded)[0].contains("a.yaml: no longer a regular file; keeping"));
        // Given as the path itself: refused, not waited on.
        assert!(ManifestSource::open(&a).is_err());
    }

    #[test]
    fn symlink_loops_are_reported_and_configmap_symlinks_followed() {
        let dir = Scratch::new();
        // A ConfigMap volume: visible symlinks into `..data`, itself a symlink to the
        // current timestamped directory.
        fs::create_dir(dir.0.join("..2024_01_01")).unwrap();
        dir.file("..2024_01_01/svc.yaml", &service_named("one"));
        std::os::unix::fs::symlink("..2024_01_01", dir.0.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/svc.yaml", dir.0.join("svc.yaml")).unwrap();
        // Broken links: a loop and a dangling one are named; a hidden loop is not read.
        std::os::unix::fs::symlink("loop.yaml", dir.0.join("loop.yaml")).unwrap();
        std::os::unix::fs::symlink("gone.yaml.orig", dir.0.join("gone.yaml")).unwrap();
        std::os::unix::fs::symlink(".hidden.yaml", dir.0.join(".hidden.yaml")).unwrap();
        let mut source = source(&dir.0);
        assert!(source.changed());
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/one@1"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].ends_with("gone.yaml: No such file or directory (os error 2)"));
        assert!(errors[1].ends_with("loop.yaml: Too many levels of symbolic links (os error 40)"));

        // The kubelet's atomic update: a new directory, then `..data` re-pointed by rename.
        assert!(!source.changed());
        fs::create_dir(dir.0.join("..2024_01_02")).unwrap();
        dir.file("..2024_01_02/svc.yaml", &service_named("two"));
        std::os::unix::fs::symlink("..2024_01_02", dir.0.join("..data_tmp")).unwrap();
        fs::rename(dir.0.join("..data_tmp"), dir.0.join("..data")).unwrap();
        assert!(source.changed());
        assert_eq!(names(&source.load().services), ["default/two@1"]);
    }

    #[test]
    fn a_vanished_or_unlistable_directory_keeps_everything() {
        let parent = Scratch::new();
        let dir = parent.0.join("manifests");
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("a.yaml"), service_named("a")).unwrap();
        let mut source = source(&dir);
        assert_eq!(names(&source.load().services), ["default/a@1"]);

        fs::rename(&dir, parent.0.join("moved")).unwrap();
        assert!(source.changed());
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains(&format!("reading {}: No such file", dir.display())));
        assert!(errors[0].ends_with("keeping the objects of the last successful read (1)"));

        // A file where the directory was is no directory to list either.
        fs::write(&dir, service_named("f")).unwrap();
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert_eq!(loaded.errors.len(), 1);
        fs::remove_file(&dir).unwrap();

        // Back, and empty: now the file is really gone.
        fs::create_dir(&dir).unwrap();
        assert!(source.changed());
        let loaded = source.load();
        assert!(loaded.errors.is_empty() && loaded.services.is_empty());
    }

    #[test]
    fn a_single_file_keeps_its_objects_while_unreadable() {
        let dir = Scratch::new();
        let file = dir.file("svc.yaml", &service_named("a"));
        let mut source = source(&file);
        assert_eq!(names(&source.load().services), ["default/a@1"]);
        make_loop(&file);
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert!(messages(&loaded)[0].contains("svc.yaml: Too many levels of symbolic links"));
        fs::remove_file(&file).unwrap();
        fs::create_dir(&file).unwrap();
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert!(messages(&loaded)[0].contains("svc.yaml: Is a directory (os error 21); keeping"));
        fs::remove_dir(&file).unwrap();
        let loaded = source.load();
        assert_eq!(names(&loaded.services), ["default/a@1"]);
        assert!(messages(&loaded)[0].contains("svc.yaml: No such file"));
    }

    #[test]
    fn changed_follows_manifest_files_only() {
        let dir = Scratch::new();
        dir.file("a.yaml", &service_named("a"));
        let mut source = source(&dir.0);
        assert!(source.changed(), "the first call always reads");
        assert!(!source.changed());
        dir.file("notes.txt", "not a manifest");
        dir.file(".a.yaml.swp", "editor state");
        assert!(!source.changed());
        dir.file("b.yml", &service_named("b"));
        assert!(source.changed());
        // Replaced by rename, as editors and kubectl-like tools do.
        let staged = dir.file("a.yaml.new", &service_named("c"));
        fs::rename(staged, dir.0.join("a.yaml")).unwrap();
        assert!(source.changed());
        assert!(!source.changed());
        make_loop(&dir.0.join("b.yml"));
        assert!(source.changed());
    }

    #[test]
    fn errors_found_while_reading_a_document_carry_the_line_in_the_file() {
        let text = format!("{SERVICE}---\napiVersion: v1\nkind: Service\nkind: Service\n");
        let loaded = load_text("dup.yaml", &text);
        assert_eq!(names(&loaded.services), ["shop/web@1"]);
        let errors = messages(&loaded);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("dup.yaml: document 2: invalid YAML: duplicate mapping key: kind"),
            "{errors:?}"
        );
        assert!(errors[0].ends_with("at line 10, column 1"), "{errors:?}");
    }
}
