//! From a command line to a REAPI Action: paths are checked and made relative to the
//! input root, declared inputs (files, directories, symlinks) are walked and digested
//! (reusing remembered digests of unchanged files), and the Directory tree, Command and
//! Action messages are built. Nothing here talks to a server.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use gantry_core::reapi::{self, command::EnvironmentVariable, DirectoryNode, FileNode, SymlinkNode};
use gantry_core::{Digest, DigestFunction};
use prost::Message;

use crate::history::{FileKey, History};
use crate::{Error, Result};

/// Prefix of the per-run temporary directories in the input root. Input walks skip
/// them, so a concurrent run's staging area never becomes part of an action.
pub const TEMP_PREFIX: &str = ".gantry-run-";

/// A file changed this recently may change again within the same mtime tick after
/// we hash it; its digest is not remembered (the "racy timestamp" problem).
const RACY_WINDOW: std::time::Duration = std::time::Duration::from_secs(2);

/// What the user asked to run, with paths as given on the command line.
#[derive(Debug, Clone)]
pub struct CommandLine {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// The input root (absolute); everything the action sees lives under it.
    pub root: PathBuf,
    /// Where the command runs (absolute, under `root`).
    pub cwd: PathBuf,
    /// Inputs, relative to `cwd` or absolute under `root`.
    pub inputs: Vec<String>,
    /// Outputs, relative to `cwd` or absolute under it.
    pub outputs: Vec<String>,
}

/// Where a blob's bytes come from when it has to be uploaded.
#[derive(Debug, Clone)]
pub enum BlobSource {
    Bytes(Bytes),
    File(PathBuf),
}

/// One input file, for staging the local branch's exec root.
#[derive(Debug, Clone)]
pub struct InputFile {
    /// Relative to the input root.
    pub rel: String,
    pub abs: PathBuf,
    pub executable: bool,
}

#[derive(Debug, Clone)]
pub struct BuiltAction {
    pub action_digest: Digest,
    pub command: reapi::Command,
    /// The command's working directory relative to the input root ("" for the root).
    pub workdir: String,
    /// Every blob the action needs in the CAS.
    pub blobs: Vec<(Digest, BlobSource)>,
    pub files: Vec<InputFile>,
    /// Input directories (relative to the root), including empty ones.
    pub dirs: Vec<String>,
    pub symlinks: Vec<(String, String)>,
    /// Input files hashed in this run, and ones whose digest was remembered.
    pub hashed: usize,
    pub remembered: usize,
}

/// Lexical normalisation: `.` dropped, `..` applied, no symlinks resolved (the user
/// means the path as written, and resolving could leave the root silently).
fn normalize(base: &Path, p: &str) -> PathBuf {
    let mut out = PathBuf::new();
    let joined = if Path::new(p).is_absolute() { PathBuf::from(p) } else { base.join(p) };
    for c in joined.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn rel_str(p: &Path, what: &str) -> Result<String> {
    p.to_str().map(str::to_string).ok_or_else(|| Error::invalid(format!("{what} {} is not valid UTF-8", p.display())))
}

/// `p` (relative to `base`, or absolute) as a path relative to `under`; an error names
/// the argument when it leaves `under`.
pub fn relative_under(under: &Path, base: &Path, p: &str, what: &str) -> Result<String> {
    if p.is_empty() {
        return Err(Error::invalid(format!("{what}: empty path")));
    }
    let abs = normalize(base, p);
    let rel =
        abs.strip_prefix(under).map_err(|_| Error::invalid(format!("{what} '{p}' is outside {}", under.display())))?;
    rel_str(rel, what)
}

#[derive(Debug)]
enum Node {
    File { digest: Digest, executable: bool },
    Symlink(String),
    Dir(BTreeMap<String, Node>),
}

fn insert(root: &mut BTreeMap<String, Node>, rel: &str, node: Node) -> Result<()> {
    let parts: Vec<&str> = rel.split('/').filter(|s| !s.is_empty()).collect();
    let Some((last, parents)) = parts.split_last() else {
        // The root itself as an input directory: its children come as their own entries.
        return Ok(());
    };
    let mut cur = root;
    for p in parents {
        let entry = cur.entry(p.to_string()).or_insert_with(|| Node::Dir(BTreeMap::new()));
        cur = match entry {
            Node::Dir(m) => m,
            _ => return Err(Error::invalid(format!("input {rel}: '{p}' is a file, not a directory"))),
        };
    }
    match (cur.get(*last), &node) {
        (Some(Node::Dir(_)), Node::Dir(_)) => {}
        (Some(_), _) => {
            // Listed twice (directly and through a directory): same content, keep one.
        }
        (None, _) => {
            cur.insert(last.to_string(), node);
        }
    }
    Ok(())
}

fn encode_dir(f: DigestFunction, entries: &BTreeMap<String, Node>, blobs: &mut Vec<(Digest, BlobSource)>) -> Digest {
    let mut dir = reapi::Directory::default();
    for (name, node) in entries {
        match node {
            Node::File { digest, executable } => dir.files.push(FileNode {
                name: name.clone(),
                digest: Some(digest.to_proto()),
                is_executable: *executable,
                ..Default::default()
            }),
            Node::Symlink(target) => {
                dir.symlinks.push(SymlinkNode { name: name.clone(), target: target.clone(), ..Default::default() })
            }
            Node::Dir(children) => {
                let d = encode_dir(f, children, blobs);
                dir.directories.push(DirectoryNode { name: name.clone(), digest: Some(d.to_proto()) });
            }
        }
    }
    let bytes = dir.encode_to_vec();
    let d = f.digest_of(&bytes);
    blobs.push((d, BlobSource::Bytes(Bytes::from(bytes))));
    d
}

/// Everything found on disk under the declared inputs.
#[derive(Default)]
struct Walk {
    files: Vec<(String, PathBuf, std::fs::Metadata)>,
    dirs: Vec<String>,
    symlinks: Vec<(String, String)>,
}

fn walk(root: &Path, rel: &str, w: &mut Walk) -> Result<()> {
    let abs = if rel.is_empty() { root.to_path_buf() } else { root.join(rel) };
    let meta = std::fs::symlink_metadata(&abs).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::invalid(format!("input {} does not exist", abs.display()))
        } else {
            Error::io(format!("stat input {}", abs.display()), e)
        }
    })?;
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target = std::fs::read_link(&abs).map_err(|e| Error::io(format!("readlink {}", abs.display()), e))?;
        w.symlinks.push((rel.to_string(), rel_str(&target, "symlink target")?));
    } else if ft.is_dir() {
        w.dirs.push(rel.to_string());
        let mut names = Vec::new();
        for e in std::fs::read_dir(&abs).map_err(|e| Error::io(format!("listing input {}", abs.display()), e))? {
            let e = e.map_err(|e| Error::io(format!("listing input {}", abs.display()), e))?;
            let name = e.file_name().into_string().map_err(|n| {
                Error::invalid(format!("input {}/{} is not valid UTF-8", abs.display(), n.to_string_lossy()))
            })?;
            if !name.starts_with(TEMP_PREFIX) {
                names.push(name);
            }
        }
        names.sort();
        for n in names {
            let child = if rel.is_empty() { n } else { format!("{rel}/{n}") };
            walk(root, &child, w)?;
        }
    } else if ft.is_file() {
        w.files.push((rel.to_string(), abs, meta));
    } else {
        return Err(Error::invalid(format!("input {} is neither a file, a directory nor a symlink", abs.display())));
    }
    Ok(())
}

fn hash_file(f: DigestFunction, path: &Path) -> Result<Digest> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(format!("opening input {}", path.display()), e))?;
    let mut h = f.hasher();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(format!("reading input {}", path.display()), e))?;
        if n == 0 {
            return Ok(h.finish());
        }
        h.update(&buf[..n]);
    }
}

/// Builds the Action for `cl`. With `history`, unchanged files are not re-hashed.
pub async fn build(cl: &CommandLine, history: Option<&History>) -> Result<BuiltAction> {
    let f = DigestFunction::Sha256;
    if cl.argv.is_empty() {
        return Err(Error::invalid("no command given (put it after --)"));
    }
    if !cl.root.is_absolute() || !cl.cwd.is_absolute() {
        return Err(Error::invalid("the root and working directory must be absolute"));
    }
    let workdir = relative_under(&cl.root, &cl.root, &cl.cwd.to_string_lossy(), "working directory")?;
    let mut inputs = Vec::new();
    for p in &cl.inputs {
        inputs.push(relative_under(&cl.root, &cl.cwd, p, "input")?);
    }
    let mut outputs = Vec::new();
    for p in &cl.outputs {
        let o = relative_under(&cl.cwd, &cl.cwd, p, "output")?;
        if o.is_empty() {
            return Err(Error::invalid(format!("output '{p}' is the working directory itself")));
        }
        let under_root = if workdir.is_empty() { o.clone() } else { format!("{workdir}/{o}") };
        if let Some(i) =
            inputs.iter().find(|i| **i == under_root || under_root.starts_with(&format!("{i}/")) || i.is_empty())
        {
            return Err(Error::invalid(format!(
                "output '{p}' is inside input '{}': a command's outputs cannot also be its inputs",
                if i.is_empty() { "." } else { i }
            )));
        }
        outputs.push(o);
    }
    outputs.sort();
    outputs.dedup();

    let root = cl.root.clone();
    let inputs_for_walk = inputs.clone();
    let w = tokio::task::spawn_blocking(move || -> Result<Walk> {
        let mut w = Walk::default();
        for rel in &inputs_for_walk {
            walk(&root, rel, &mut w)?;
        }
        Ok(w)
    })
    .await
    .map_err(|e| gantry_core::Error::internal(format!("input walk task: {e}")))??;

    // Remembered digests first, then hash the rest off the async threads.
    let mut digests: Vec<Option<Digest>> = Vec::with_capacity(w.files.len());
    for (_, abs, meta) in &w.files {
        digests.push(match history {
            Some(h) => h.cached_digest(abs, &FileKey::of(meta), f).await?,
            None => None,
        });
    }
    let remembered = digests.iter().filter(|d| d.is_some()).count();
    let todo: Vec<(usize, PathBuf)> = w
        .files
        .iter()
        .enumerate()
        .filter(|(i, _)| digests[*i].is_none())
        .map(|(i, (_, a, _))| (i, a.clone()))
        .collect();
    let hashed = todo.len();
    let hash_started = std::time::SystemTime::now();
    let computed = tokio::task::spawn_blocking(move || -> Result<Vec<(usize, Digest)>> {
        todo.into_iter().map(|(i, p)| Ok((i, hash_file(f, &p)?))).collect()
    })
    .await
    .map_err(|e| gantry_core::Error::internal(format!("hash task: {e}")))??;
    let mut to_store = Vec::new();
    for (i, d) in computed {
        let (_, abs, meta) = &w.files[i];
        // Re-check after hashing: a file written meanwhile must not be remembered.
        let now_meta =
            std::fs::symlink_metadata(abs).map_err(|e| Error::io(format!("stat input {}", abs.display()), e))?;
        let key = FileKey::of(meta);
        let settled = meta
            .modified()
            .ok()
            .and_then(|m| hash_started.duration_since(m).ok())
            .is_some_and(|age| age >= RACY_WINDOW);
        if FileKey::of(&now_meta) != key {
            return Err(Error::invalid(format!("input {} changed while it was being hashed", abs.display())));
        }
        if settled {
            to_store.push((abs.clone(), key, d));
        }
        digests[i] = Some(d);
    }
    if let Some(h) = history {
        h.store_digests(&to_store).await?;
    }

    let mut tree = BTreeMap::new();
    let mut blobs = Vec::new();
    let mut files = Vec::new();
    for d in &w.dirs {
        insert(&mut tree, d, Node::Dir(BTreeMap::new()))?;
    }
    for ((rel, abs, meta), digest) in w.files.iter().zip(digests) {
        let digest = digest.expect("every file was remembered or hashed");
        let executable = meta.permissions().mode() & 0o111 != 0;
        insert(&mut tree, rel, Node::File { digest, executable })?;
        blobs.push((digest, BlobSource::File(abs.clone())));
        files.push(InputFile { rel: rel.clone(), abs: abs.clone(), executable });
    }
    for (rel, target) in &w.symlinks {
        insert(&mut tree, rel, Node::Symlink(target.clone()))?;
    }
    // The working directory must exist in the input root even if no input is in it.
    if !workdir.is_empty() {
        insert(&mut tree, &workdir, Node::Dir(BTreeMap::new()))?;
    }
    let input_root = encode_dir(f, &tree, &mut blobs);

    let mut env: Vec<EnvironmentVariable> =
        cl.env.iter().map(|(k, v)| EnvironmentVariable { name: k.clone(), value: v.clone() }).collect();
    env.sort_by(|a, b| a.name.cmp(&b.name));
    env.dedup_by(|a, b| a.name == b.name);
    let command = reapi::Command {
        arguments: cl.argv.clone(),
        environment_variables: env,
        output_paths: outputs,
        working_directory: workdir.clone(),
        ..Default::default()
    };
    let cbytes = command.encode_to_vec();
    let command_digest = f.digest_of(&cbytes);
    blobs.push((command_digest, BlobSource::Bytes(Bytes::from(cbytes))));
    let action = reapi::Action {
        command_digest: Some(command_digest.to_proto()),
        input_root_digest: Some(input_root.to_proto()),
        ..Default::default()
    };
    let abytes = action.encode_to_vec();
    let action_digest = f.digest_of(&abytes);
    blobs.push((action_digest, BlobSource::Bytes(Bytes::from(abytes))));
    blobs.sort_by_key(|(d, _)| *d);
    blobs.dedup_by_key(|(d, _)| *d);
    let mut dirs = w.dirs;
    dirs.retain(|d| !d.is_empty());
    Ok(BuiltAction { action_digest, command, workdir, blobs, files, dirs, symlinks: w.symlinks, hashed, remembered })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_outside_the_root_are_refused_by_name() {
        let root = Path::new("/w/proj");
        assert_eq!(relative_under(root, Path::new("/w/proj/sub"), "a/../b.c", "input").unwrap(), "sub/b.c");
        assert_eq!(relative_under(root, root, "/w/proj/x", "input").unwrap(), "x");
        let e = relative_under(root, root, "../etc/passwd", "input").unwrap_err().to_string();
        assert!(e.contains("input '../etc/passwd' is outside /w/proj"), "{e}");
        assert!(relative_under(root, root, "", "output").is_err());
    }

    #[tokio::test]
    async fn action_is_deterministic_and_refuses_outputs_among_inputs() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("src")).unwrap();
        std::fs::write(d.path().join("src/a.c"), "int a;").unwrap();
        std::fs::create_dir(d.path().join(format!("src/{TEMP_PREFIX}x"))).unwrap();
        let cl = CommandLine {
            argv: vec!["cc".into(), "-c".into(), "src/a.c".into()],
            env: vec![("PATH".into(), "/usr/bin".into())],
            root: d.path().to_owned(),
            cwd: d.path().to_owned(),
            inputs: vec!["src".into()],
            outputs: vec!["a.o".into()],
        };
        let a = build(&cl, None).await.unwrap();
        let b = build(&cl, None).await.unwrap();
        assert_eq!(a.action_digest, b.action_digest);
        assert_eq!(a.files.len(), 1, "temp dirs of other runs are not inputs: {:?}", a.files);
        std::fs::write(d.path().join("src/a.c"), "int b;").unwrap();
        assert_ne!(build(&cl, None).await.unwrap().action_digest, a.action_digest);
        let bad = CommandLine { outputs: vec!["src/a.o".into()], ..cl };
        let e = build(&bad, None).await.unwrap_err().to_string();
        assert!(e.contains("output 'src/a.o' is inside input 'src'"), "{e}");
    }

    #[tokio::test]
    async fn unchanged_old_files_are_not_hashed_again() {
        let d = tempfile::tempdir().unwrap();
        let db = tempfile::tempdir().unwrap();
        let h = History::open(db.path()).await.unwrap();
        std::fs::write(d.path().join("old.txt"), "old").unwrap();
        std::fs::write(d.path().join("new.txt"), "new").unwrap();
        // Back-date one file past the racy window; the fresh one is never remembered.
        let old = std::fs::File::options().write(true).open(d.path().join("old.txt")).unwrap();
        old.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60)).unwrap();
        let cl = CommandLine {
            argv: vec!["true".into()],
            env: vec![],
            root: d.path().to_owned(),
            cwd: d.path().to_owned(),
            inputs: vec!["old.txt".into(), "new.txt".into()],
            outputs: vec![],
        };
        let first = build(&cl, Some(&h)).await.unwrap();
        assert_eq!((first.hashed, first.remembered), (2, 0));
        let second = build(&cl, Some(&h)).await.unwrap();
        assert_eq!((second.hashed, second.remembered), (1, 1));
        assert_eq!(first.action_digest, second.action_digest);
        // Changing the content (and so size/mtime/ctime) invalidates the remembered digest.
        std::fs::write(d.path().join("old.txt"), "changed").unwrap();
        let third = build(&cl, Some(&h)).await.unwrap();
        assert_eq!(third.remembered, 0);
        assert_ne!(third.action_digest, first.action_digest);
    }
}
