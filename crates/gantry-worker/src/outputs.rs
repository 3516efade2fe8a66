//! Collecting an action's outputs: files (with their executable bit), directories as
//! Tree messages, symlinks as symlinks; every blob is uploaded to the CAS unless it is
//! there already.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use gantry_core::reapi::{
    ActionResult, Directory, DirectoryNode, FileNode, OutputDirectory, OutputFile, OutputSymlink, SymlinkNode, Tree,
};
use gantry_core::{BlobStore, Digest, DigestFunction, Error, Result, ResultExt};
use prost::Message;

const UPLOAD_CHUNK: usize = 1 << 20;

pub struct Uploader {
    pub cas: Arc<dyn BlobStore>,
    pub function: DigestFunction,
}

/// An output file as it was hashed and uploaded: its bytes, read whole.
pub struct WrittenFile {
    pub path: PathBuf,
    pub digest: Digest,
    pub data: Bytes,
}

/// What the command declared as outputs, relative to its working directory.
pub struct Declared<'a> {
    pub files: &'a [String],
    pub directories: &'a [String],
    /// REAPI v2.1 `output_paths`: the type is whatever the command produced.
    pub paths: &'a [String],
}

impl Uploader {
    /// Digests a file and uploads it if the CAS lacks it.
    pub async fn upload_file(&self, path: &Path) -> Result<Digest> {
        Ok(self.upload_file_keeping(path).await?.0)
    }

    /// `upload_file`, with the bytes that were hashed when they fit in one chunk.
    async fn upload_file_keeping(&self, path: &Path) -> Result<(Digest, Option<Bytes>)> {
        let (file, len) = open_output(path)?;
        let (p, f) = (path.to_owned(), self.function);
        let small = len <= crate::INLINE_FILE_BYTES;
        let (digest, bytes) = crate::blocking_unless_small(small, move || hash_file(f, file, len, &p)).await?;
        let bytes = bytes.map(Bytes::from);
        Ok((self.upload_hashed(path, digest, bytes.clone()).await?, bytes))
    }

    /// `upload_file` of a command's stdout and stderr, hashed together: most commands'
    /// logs are empty or tiny, and a blocking task is a handoff between threads.
    /// An empty log (most are) costs one stat, not an open, a stat, a read and a close.
    pub async fn upload_logs(&self, stdout: &Path, stderr: &Path) -> Result<(Digest, Digest)> {
        let open = |p: &Path| match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_file() && m.len() == 0 => Ok(None),
            // Anything else (a link, a missing file) gets `open_output`'s own error.
            _ => open_output(p).map(Some),
        };
        let (out_file, err_file) = (open(stdout)?, open(stderr)?);
        let (out, err, f) = (stdout.to_owned(), stderr.to_owned(), self.function);
        let len = |o: &Option<(std::fs::File, u64)>| o.as_ref().map_or(0, |(_, len)| *len);
        let small = len(&out_file).max(len(&err_file)) <= crate::INLINE_FILE_BYTES;
        let (o, e) = crate::blocking_unless_small(small, move || {
            let hash = |o: Option<(std::fs::File, u64)>, p: &Path| match o {
                None => Ok((f.empty(), Some(Vec::new()))),
                Some((file, len)) => hash_file(f, file, len, p),
            };
            Ok((hash(out_file, &out)?, hash(err_file, &err)?))
        })
        .await?;
        Ok((
            self.upload_hashed(stdout, o.0, o.1.map(Bytes::from)).await?,
            self.upload_hashed(stderr, e.0, e.1.map(Bytes::from)).await?,
        ))
    }

    /// Uploads the file at `path`, hashed as `digest` (`small`: its bytes, when it fits in
    /// one chunk), unless the CAS has it.
    async fn upload_hashed(&self, path: &Path, digest: Digest, small: Option<Bytes>) -> Result<Digest> {
        if self.cas.has(&digest).await? {
            return Ok(digest);
        }
        match small {
            Some(data) => self.cas.put(&digest, data).await?,
            None => {
                let mut w = self.cas.begin_write(&digest).await?;
                let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes>>(2);
                let p = path.to_owned();
                let size = digest.size;
                let reader = tokio::task::spawn_blocking(move || {
                    use std::io::Read;
                    // Opened as it was to be hashed; the bytes that were hashed, no more.
                    let mut file = match open_output(&p) {
                        Ok((f, _)) => f.take(size),
                        Err(e) => {
                            let _ = tx.blocking_send(Err(e));
                            return;
                        }
                    };
                    loop {
                        let mut buf = vec![0u8; UPLOAD_CHUNK];
                        match file.read(&mut buf) {
                            Ok(0) => return,
                            Ok(n) => {
                                buf.truncate(n);
                                if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                                    return;
                                }
                            }
                            Err(e) => {
                                let _ = tx.blocking_send(Err(Error::io(format!("reading {}", p.display()), e)));
                                return;
                            }
                        }
                    }
                });
                while let Some(chunk) = rx.recv().await {
                    w.write(chunk?).await?;
                }
                reader.await.map_err(|e| Error::internal(format!("read task: {e}")))?;
                w.commit().await?;
            }
        }
        Ok(digest)
    }

    async fn upload_bytes(&self, data: Vec<u8>) -> Result<Digest> {
        let d = self.function.digest_of(&data);
        if !self.cas.has(&d).await? {
            self.cas.put(&d, Bytes::from(data)).await?;
        }
        Ok(d)
    }

    /// Builds (and uploads) the Directory for `dir`, adding every descendant to
    /// `children`.
    fn directory<'a>(
        &'a self,
        dir: &'a Path,
        children: &'a mut BTreeMap<Digest, Directory>,
    ) -> futures::future::BoxFuture<'a, Result<Directory>> {
        Box::pin(async move {
            let mut entries: Vec<_> = std::fs::read_dir(dir)
                .context(format_args!("listing output directory {}", dir.display()))?
                .collect::<std::io::Result<Vec<_>>>()
                .context(format_args!("listing {}", dir.display()))?;
            entries.sort_by_key(|e| e.file_name());
            let mut out = Directory::default();
            for e in entries {
                let name = e.file_name().to_string_lossy().into_owned();
                let path = e.path();
                let meta = std::fs::symlink_metadata(&path).context(format_args!("stat {}", path.display()))?;
                if meta.file_type().is_symlink() {
                    let target = std::fs::read_link(&path).context(format_args!("readlink {}", path.display()))?;
                    out.symlinks.push(SymlinkNode {
                        name,
                        target: target.to_string_lossy().into_owned(),
                        ..Default::default()
                    });
                } else if meta.is_dir() {
                    let sub = self.directory(&path, children).await?;
                    let bytes = sub.encode_to_vec();
                    let d = self.function.digest_of(&bytes);
                    children.insert(d, sub);
                    out.directories.push(DirectoryNode { name, digest: Some(d.to_proto()) });
                } else {
                    let d = self.upload_file(&path).await?;
                    out.files.push(FileNode {
                        name,
                        digest: Some(d.to_proto()),
                        is_executable: meta.permissions().mode() & 0o111 != 0,
                        ..Default::default()
                    });
                }
            }
            Ok(out)
        })
    }

    /// Uploads every declared output that exists and records it in `result`. Returns the
    /// output files (not those inside output directories) whose bytes were read whole.
    pub async fn collect(
        &self,
        cwd: &Path,
        declared: &Declared<'_>,
        result: &mut ActionResult,
    ) -> Result<Vec<WrittenFile>> {
        let mut written = Vec::new();
        let mut all: Vec<(&String, Option<bool>)> = Vec::new();
        all.extend(declared.files.iter().map(|p| (p, Some(false))));
        all.extend(declared.directories.iter().map(|p| (p, Some(true))));
        all.extend(declared.paths.iter().map(|p| (p, None)));
        all.sort();
        all.dedup_by(|a, b| a.0 == b.0);
        for (rel, expect_dir) in all {
            let path = cwd.join(rel);
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // not produced
                Err(e) => return Err(Error::io(format!("stat output {rel}"), e)),
            };
            if meta.file_type().is_symlink() {
                let target =
                    std::fs::read_link(&path).context(format_args!("readlink {rel}"))?.to_string_lossy().into_owned();
                let link = OutputSymlink { path: rel.clone(), target, ..Default::default() };
                let points_to_dir = std::fs::metadata(&path).map(|m| m.is_dir()).unwrap_or(false);
                #[allow(deprecated)]
                if points_to_dir {
                    result.output_directory_symlinks.push(link.clone());
                } else {
                    result.output_file_symlinks.push(link.clone());
                }
                result.output_symlinks.push(link);
            } else if meta.is_dir() {
                if expect_dir == Some(false) {
                    return Err(Error::FailedPrecondition(format!("output file {rel} is a directory")));
                }
                let mut children = BTreeMap::new();
                let root = self.directory(&path, &mut children).await?;
                let tree = Tree { root: Some(root), children: children.into_values().collect() };
                let tree_digest = self.upload_bytes(tree.encode_to_vec()).await?;
                result.output_directories.push(OutputDirectory {
                    path: rel.clone(),
                    tree_digest: Some(tree_digest.to_proto()),
                    ..Default::default()
                });
            } else {
                if expect_dir == Some(true) {
                    return Err(Error::FailedPrecondition(format!("output directory {rel} is a file")));
                }
                let (d, bytes) = self.upload_file_keeping(&path).await?;
                result.output_files.push(OutputFile {
                    path: rel.clone(),
                    digest: Some(d.to_proto()),
                    is_executable: meta.permissions().mode() & 0o111 != 0,
                    ..Default::default()
                });
                if let Some(data) = bytes {
                    written.push(WrittenFile { path, digest: d, data });
                }
            }
        }
        Ok(written)
    }
}

/// Opens an output to hash it, with its length. Without waiting: a FIFO the command left
/// would block a plain open until a writer came, so it is opened non-blocking, and anything
/// but a regular file is refused. A link is not followed: outputs that are links were
/// recorded as links before this, and a log is never one unless the command made it so.
fn open_output(p: &Path) -> Result<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW).open(p) {
        Ok(f) => f,
        // A command's doing (outputs that are links were recorded as links), not the
        // worker's: a failed precondition, which a client does not retry as a fault.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Error::FailedPrecondition(format!("output {} is a symbolic link", p.display())));
        }
        Err(e) => return Err(Error::io(format!("opening output {}", p.display()), e)),
    };
    let meta = file.metadata().context(format_args!("stat output {}", p.display()))?;
    if !meta.is_file() {
        return Err(Error::FailedPrecondition(format!("output {} is not a regular file", p.display())));
    }
    Ok((file, meta.len()))
}

/// Digests `file` (at `p`, `len` bytes when opened); with its bytes when it fits in one
/// upload chunk.
fn hash_file(f: DigestFunction, file: std::fs::File, len: u64, p: &Path) -> Result<(Digest, Option<Vec<u8>>)> {
    use std::io::Read;
    // The length it had when opened: a file something still appends to is not read on
    // and on (and its upload is checked against this digest).
    let mut file = file.take(len);
    let mut h = f.hasher();
    // Sized to the file (one byte more, to read its end in the same call): most
    // outputs, and stdout and stderr above all, are tiny or empty, and zeroing a
    // whole chunk for each was a visible share of a no-op action's CPU.
    let mut buf = vec![0u8; (len.saturating_add(1)).min(UPLOAD_CHUNK as u64) as usize];
    let mut first = Vec::new();
    loop {
        let n = file.read(&mut buf).context(format_args!("reading {}", p.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        if first.len() < UPLOAD_CHUNK {
            first.extend_from_slice(&buf[..n]);
        }
    }
    let d = h.finish();
    // Small files are uploaded from memory; large ones are streamed again.
    let small = (d.size as usize <= UPLOAD_CHUNK).then_some(first);
    Ok((d, small))
}
