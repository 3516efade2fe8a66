//! The CAS browser: look up any digest and see it decoded as what it is, a blob, a
//! Directory, a Tree, an Action, a Command or an ActionResult, with every digest inside
//! linked to its own view and every file downloadable. An action's input tree is browsed
//! from its input root's Directory.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Redirect, Response};
use gantry_core::{reapi, Digest, DigestFunction};
use http::StatusCode;
use maud::{html, Markup};
use prost::Message;

use crate::pages::{self, layout, percent_encode, shorten};
use crate::{failure, query_param, read_proto, server_error, Web, MAX_BLOB_VIEW};

/// What a digest can be shown as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Blob,
    Directory,
    Tree,
    Action,
    Command,
    Result,
}

impl Kind {
    pub const ALL: [Kind; 6] = [Kind::Blob, Kind::Directory, Kind::Tree, Kind::Action, Kind::Command, Kind::Result];

    pub fn path(self) -> &'static str {
        match self {
            Kind::Blob => "blob",
            Kind::Directory => "directory",
            Kind::Tree => "tree",
            Kind::Action => "action",
            Kind::Command => "command",
            Kind::Result => "result",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Kind::Blob => "Blob",
            Kind::Directory => "Directory",
            Kind::Tree => "Tree",
            Kind::Action => "Action",
            Kind::Command => "Command",
            Kind::Result => "ActionResult",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.path() == s)
    }
}

/// The view of `d` as `kind`.
pub fn link(kind: Kind, d: &reapi::Digest) -> String {
    format!("/cas/{}/{}/{}", kind.path(), d.hash, d.size_bytes)
}

/// A file's download: the blob with the file's name.
pub fn download(d: &reapi::Digest, name: &str) -> String {
    format!("/blobs/{}/{}?download={}", d.hash, d.size_bytes, percent_encode(name))
}

/// Parses `HASH/SIZE` (or `HASH SIZE`, or `HASH-SIZE` as in the CAS's file names).
pub fn parse_digest(s: &str) -> Result<Digest, String> {
    let s = s.trim();
    let (hash, size) =
        s.split_once(['/', ' ', '-']).ok_or_else(|| format!("digest: {:?} is not HASH/SIZE", shorten(s, 80)))?;
    let size: i64 = size.trim().parse().map_err(|_| format!("digest: size {:?} is not a number", shorten(size, 40)))?;
    Digest::parse(DigestFunction::Sha256, hash.trim(), size).map_err(|e| format!("digest: {e}"))
}

fn form(value: &str, kind: Kind, instance: &str) -> Markup {
    html! {
        form method="get" action="/cas" {
            label { "Digest " input name="digest" size="80" value=(value) placeholder="HASH/SIZE"; }
            " as "
            select name="kind" {
                @for k in Kind::ALL {
                    option value=(k.path()) selected[k == kind] { (k.title()) }
                }
            }
            " " label { "instance " input name="instance" size="12" value=(instance); }
            " " button type="submit" { "Show" }
        }
    }
}

/// The lookup form, with what the CAS holds.
pub fn search_page() -> Markup {
    layout(
        "CAS",
        html! {
            h1 { "Content-addressable storage" }
            p { "Look up any digest (SHA-256) and see it decoded. Digests inside are linked: a Directory's files \
                 download, its subdirectories open, an Action leads to its Command and input tree." }
            (form("", Kind::Blob, ""))
        },
    )
}

/// One Directory's entries; subdirectories link to `sub(name, digest)`.
pub fn directory_table(dir: &reapi::Directory, sub: &dyn Fn(&str, &reapi::Digest) -> String) -> Markup {
    html! {
        table {
            tr { th { "Name" } th { "Size" } th { "" } }
            @for d in &dir.directories {
                tr {
                    td { @match &d.digest { Some(dg) => a href=(sub(&d.name, dg)) { (d.name) "/" }, None => { (d.name) "/" } } }
                    td class="n" { "—" }
                    td class="dim" { "directory" }
                }
            }
            @for f in &dir.files {
                tr {
                    td { @match &f.digest { Some(dg) => a href=(download(dg, &f.name)) { (f.name) }, None => (f.name) } }
                    td class="n" { (f.digest.as_ref().map_or(0, |d| d.size_bytes)) }
                    td class="dim" {
                        @if f.is_executable { "executable " }
                        @if let Some(dg) = &f.digest { a href=(link(Kind::Blob, dg)) { "view" } }
                    }
                }
            }
            @for l in &dir.symlinks {
                tr { td { (l.name) } td class="n" { "—" } td class="dim" { "→ " code { (l.target) } } }
            }
        }
    }
}

/// A Tree: its root, then each child Directory (as the Tree holds them, found by digest).
pub fn tree(digest: &Digest, t: &reapi::Tree) -> Markup {
    let children: HashMap<String, &reapi::Directory> =
        t.children.iter().map(|c| (DigestFunction::Sha256.digest_of(&c.encode_to_vec()).hash_hex(), c)).collect();
    // Subdirectories link to anchors on this page: the Tree's children are not
    // necessarily blobs of their own in the CAS.
    let sub = |_: &str, d: &reapi::Digest| {
        if children.contains_key(&d.hash) {
            format!("#d{}", d.hash)
        } else {
            link(Kind::Directory, d)
        }
    };
    layout(
        "Tree",
        html! {
            h1 { "Tree " code { (digest.hash_hex()) "/" (digest.size) } }
            p { (t.children.len()) " directories below the root." }
            h2 { "/" }
            @match &t.root { Some(root) => (directory_table(root, &sub)), None => p class="dim" { "No root." } }
            @for c in &t.children {
                @let h = DigestFunction::Sha256.digest_of(&c.encode_to_vec()).hash_hex();
                h3 id={ "d" (h) } { code { (shorten(&h, 16)) } }
                (directory_table(c, &sub))
            }
        },
    )
}

/// A Directory; `path` is where it was reached from (for the heading only).
pub fn directory(digest: &Digest, dir: &reapi::Directory, path: &str) -> Markup {
    let sub = |name: &str, d: &reapi::Digest| {
        let next = if path.is_empty() { name.to_string() } else { format!("{path}/{name}") };
        format!("{}?path={}", link(Kind::Directory, d), percent_encode(&next))
    };
    layout(
        "Directory",
        html! {
            h1 { "Directory " code { (if path.is_empty() { "/" } else { path }) } }
            p class="dim" { code { (digest.hash_hex()) "/" (digest.size) } }
            (directory_table(dir, &sub))
        },
    )
}

/// A Command. (Bazel 4 still sends the deprecated output and platform fields, so they
/// are shown.)
#[allow(deprecated)]
pub fn command(digest: &Digest, c: &reapi::Command) -> Markup {
    layout(
        "Command",
        html! {
            h1 { "Command " code { (shorten(&digest.hash_hex(), 12)) } }
            h2 { "Arguments" }
            ol { @for a in &c.arguments { li { code { (shorten(a, 4000)) } } } }
            @if !c.working_directory.is_empty() { p { "Working directory: " code { (c.working_directory) } } }
            @if !c.environment_variables.is_empty() {
                h2 { "Environment" }
                table { @for v in &c.environment_variables { tr { td { code { (v.name) } } td { code { (v.value) } } } } }
            }
            @let outputs: Vec<&String> = c.output_paths.iter().chain(&c.output_files).chain(&c.output_directories).collect();
            @if !outputs.is_empty() {
                h2 { "Outputs" }
                ul { @for o in outputs { li { code { (o) } } } }
            }
            @if let Some(p) = &c.platform {
                @if !p.properties.is_empty() {
                    h2 { "Platform" }
                    table { @for p in &p.properties { tr { td { code { (p.name) } } td { (p.value) } } } }
                }
            }
        },
    )
}

/// A blob: its size and, when it is text, its start; and links to see it as each kind.
pub fn blob(digest: &Digest, bytes: Option<&[u8]>) -> Markup {
    let raw = format!("/blobs/{}/{}", digest.hash_hex(), digest.size);
    let proto = reapi::Digest { hash: digest.hash_hex(), size_bytes: digest.size as i64 };
    layout(
        "Blob",
        html! {
            h1 { "Blob " code { (digest.hash_hex()) "/" (digest.size) } }
            @match bytes {
                None => p class="bad" { "Not in the CAS." },
                Some(b) => {
                    p { (b.len()) " bytes. " a href=(raw) { "Raw" } " · " a href=(download(&proto, "blob")) { "Download" } }
                    p { "See it as: " @for k in &Kind::ALL[1..] { a href=(link(*k, &proto)) { (k.title()) } " " } }
                    @match std::str::from_utf8(&b[..b.len().min(64 << 10)]) {
                        Ok(text) => pre { (text) @if b.len() > 64 << 10 { "\n…" } },
                        Err(_) => p class="dim" { "Binary; the first bytes: " code { (hex(&b[..b.len().min(64)])) } },
                    }
                }
            }
        },
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" ")
}

/// An ActionResult stored as a blob (the action page shows the cached one).
pub fn result(digest: &Digest, r: &reapi::ActionResult) -> Markup {
    layout(
        "ActionResult",
        html! {
            h1 { "ActionResult " code { (shorten(&digest.hash_hex(), 12)) } }
            (pages::result_section(r))
        },
    )
}

/// `/cas?digest=…&kind=…`: the form, or a redirect to the view it asks for.
pub(crate) async fn search(RawQuery(query): RawQuery) -> Response {
    let q = query.as_deref();
    let value = match query_param(q, "digest") {
        Ok(Some(v)) if !v.trim().is_empty() => v,
        Ok(_) => return search_page().into_response(),
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let digest = match parse_digest(&value) {
        Ok(d) => d,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let kind = match query_param(q, "kind") {
        Ok(None) => Kind::Blob,
        Ok(Some(k)) => match Kind::parse(&k) {
            Some(k) => k,
            None => {
                return failure(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "kind: {:?} is not one of blob, directory, tree, action, command, result",
                        shorten(&k, 40)
                    ),
                )
            }
        },
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let instance = query_param(q, "instance").ok().flatten().unwrap_or_default();
    let target = match kind {
        Kind::Action => {
            format!("/actions/{}/{}?instance={}", digest.hash_hex(), digest.size, percent_encode(&instance))
        }
        k => format!("/cas/{}/{}/{}", k.path(), digest.hash_hex(), digest.size),
    };
    Redirect::to(&target).into_response()
}

/// `/cas/{kind}/{hash}/{size}`: the digest decoded as `kind`.
pub(crate) async fn view(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
    Path((kind, hash, size)): Path<(String, String, i64)>,
    RawQuery(query): RawQuery,
) -> Response {
    // The CAS is shared by every instance: reading it needs `read` on some instance.
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Read) {
        return refused;
    }
    let Some(kind) = Kind::parse(&kind) else {
        return failure(
            StatusCode::NOT_FOUND,
            "no such view: the kinds are blob, directory, tree, action, command, result",
        );
    };
    let digest = match Digest::parse(DigestFunction::Sha256, &hash, size) {
        Ok(d) => d,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let missing = || failure(StatusCode::NOT_FOUND, &format!("{} is not in the CAS", digest));
    match kind {
        Kind::Action => Redirect::to(&format!("/actions/{}/{}", digest.hash_hex(), digest.size)).into_response(),
        Kind::Blob => {
            if digest.size > MAX_BLOB_VIEW {
                return failure(StatusCode::PAYLOAD_TOO_LARGE, &format!("the blob has {} bytes", digest.size));
            }
            match web.cas.get(&digest).await {
                Ok(b) => blob(&digest, Some(&b)).into_response(),
                Err(gantry_core::Error::NotFound(_)) => (StatusCode::NOT_FOUND, blob(&digest, None)).into_response(),
                Err(e) => server_error(e),
            }
        }
        Kind::Directory => match read_proto::<reapi::Directory>(&web, &digest, "directory").await {
            Ok(Some(d)) => {
                let path = query_param(query.as_deref(), "path").ok().flatten().unwrap_or_default();
                directory(&digest, &d, &path).into_response()
            }
            Ok(None) => missing(),
            Err(r) => r,
        },
        Kind::Tree => match read_proto::<reapi::Tree>(&web, &digest, "tree").await {
            Ok(Some(t)) => tree(&digest, &t).into_response(),
            Ok(None) => missing(),
            Err(r) => r,
        },
        Kind::Command => match read_proto::<reapi::Command>(&web, &digest, "command").await {
            Ok(Some(c)) => command(&digest, &c).into_response(),
            Ok(None) => missing(),
            Err(r) => r,
        },
        Kind::Result => match read_proto::<reapi::ActionResult>(&web, &digest, "action result").await {
            Ok(Some(r)) => result(&digest, &r).into_response(),
            Ok(None) => missing(),
            Err(r) => r,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVIL: &str = "<script>alert(1)</script>";

    fn d(s: &str) -> reapi::Digest {
        DigestFunction::Sha256.digest_of(s.as_bytes()).to_proto()
    }

    #[test]
    fn digests_parse_in_the_usual_spellings() {
        let h = "a".repeat(64);
        for s in [format!("{h}/12"), format!(" {h} 12 "), format!("{h}-12")] {
            assert_eq!(parse_digest(&s).unwrap().size, 12, "{s}");
        }
        assert!(parse_digest("abc").unwrap_err().starts_with("digest:"));
        assert!(parse_digest(&format!("{h}/x")).unwrap_err().contains("size"));
        assert!(parse_digest("zz/1").is_err());
    }

    #[test]
    fn a_directory_links_files_to_downloads_and_directories_to_their_views() {
        let dir = reapi::Directory {
            files: vec![reapi::FileNode {
                name: EVIL.into(),
                digest: Some(d("f")),
                is_executable: true,
                ..Default::default()
            }],
            directories: vec![reapi::DirectoryNode { name: "sub dir".into(), digest: Some(d("s")) }],
            symlinks: vec![reapi::SymlinkNode { name: "l".into(), target: EVIL.into(), ..Default::default() }],
            ..Default::default()
        };
        let digest = DigestFunction::Sha256.digest_of(b"dir");
        let page = directory(&digest, &dir, "a").into_string();
        assert!(!page.contains(EVIL) && page.contains("&lt;script&gt;"));
        assert!(page.contains(&format!("/cas/directory/{}/1?path=a%2Fsub%20dir", d("s").hash)), "{page}");
        assert!(page.contains(&format!("/blobs/{}/1?download=%3Cscript", d("f").hash)), "{page}");
        assert!(page.contains("executable"));
    }

    #[test]
    fn a_tree_links_its_children_inside_the_page() {
        let child = reapi::Directory {
            files: vec![reapi::FileNode { name: "inner.txt".into(), digest: Some(d("i")), ..Default::default() }],
            ..Default::default()
        };
        let child_digest = DigestFunction::Sha256.digest_of(&child.encode_to_vec()).to_proto();
        let t = reapi::Tree {
            root: Some(reapi::Directory {
                directories: vec![reapi::DirectoryNode { name: "c".into(), digest: Some(child_digest.clone()) }],
                ..Default::default()
            }),
            children: vec![child],
        };
        let page = tree(&DigestFunction::Sha256.digest_of(b"t"), &t).into_string();
        assert!(page.contains(&format!("href=\"#d{}\"", child_digest.hash)), "{page}");
        assert!(page.contains(&format!("id=\"d{}\"", child_digest.hash)));
        assert!(page.contains("inner.txt"));
    }

    #[test]
    fn commands_and_blobs_are_escaped() {
        let c = reapi::Command { arguments: vec![EVIL.into()], output_paths: vec![EVIL.into()], ..Default::default() };
        let digest = DigestFunction::Sha256.digest_of(b"c");
        assert!(!command(&digest, &c).into_string().contains(EVIL));
        let page = blob(&digest, Some(EVIL.as_bytes())).into_string();
        assert!(!page.contains(EVIL) && page.contains("&lt;script&gt;"));
        assert!(blob(&digest, Some(&[0xff, 0xfe, 0])).into_string().contains("ff fe 00"));
    }
}
