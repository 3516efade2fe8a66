//! ByteStream resource names, as REAPI defines them:
//!
//! - read:  `[{instance}/]blobs/[{function}/]{hash}/{size}[/{metadata}]` and
//!   `[{instance}/]compressed-blobs/{compressor}/[{function}/]{hash}/{size}`
//! - write: `[{instance}/]uploads/{uuid}/blobs/...` and `.../uploads/{uuid}/compressed-blobs/...`
//!
//! The instance name is everything before the first reserved segment, which is why instance
//! names may not contain `blobs`, `uploads` or `compressed-blobs` as a segment.

use crate::{Digest, DigestFunction, Error, Result};

/// How the bytes of a resource are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compressor {
    Identity,
    Zstd,
}

impl Compressor {
    pub fn from_proto(value: i32) -> Result<Self> {
        use crate::reapi::compressor::Value;
        match Value::try_from(value) {
            Ok(Value::Identity) => Ok(Self::Identity),
            Ok(Value::Zstd) => Ok(Self::Zstd),
            Ok(other) => Err(Error::invalid(format!(
                "compressor {} is not supported (supported: identity, zstd)",
                other.as_str_name()
            ))),
            Err(_) => Err(Error::invalid(format!("compressor: unknown value {value}"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceName {
    pub instance: String,
    /// Set for write resource names (`uploads/{uuid}/...`).
    pub upload_id: Option<String>,
    pub compressor: Compressor,
    /// The digest of the *uncompressed* blob.
    pub digest: Digest,
}

const RESERVED: [&str; 3] = ["blobs", "compressed-blobs", "uploads"];

impl ResourceName {
    pub fn parse_read(name: &str) -> Result<Self> {
        let r = parse(name).map_err(|e| e.context(format_args!("resource_name '{}'", shorten(name))))?;
        if r.upload_id.is_some() {
            return Err(Error::invalid(format!(
                "resource_name '{}': an uploads/ name cannot be read; use {{instance}}/blobs/{{hash}}/{{size}}",
                shorten(name)
            )));
        }
        Ok(r)
    }

    pub fn parse_write(name: &str) -> Result<Self> {
        let r = parse(name).map_err(|e| e.context(format_args!("resource_name '{}'", shorten(name))))?;
        if r.upload_id.is_none() {
            return Err(Error::invalid(format!(
                "resource_name '{}': a write needs {{instance}}/uploads/{{uuid}}/blobs/{{hash}}/{{size}}",
                shorten(name)
            )));
        }
        Ok(r)
    }
}

/// `blobs/[{function}/]{hash}/{size}`: the blob's part of a resource name (SHA-256, the
/// default function, is left implicit, as every client expects).
pub fn blob_path(d: &Digest) -> String {
    match d.function {
        DigestFunction::Sha256 => format!("blobs/{}/{}", d.hash_hex(), d.size),
        f => format!("blobs/{}/{}/{}", f.name(), d.hash_hex(), d.size),
    }
}

fn instance_prefix(instance: &str) -> String {
    if instance.is_empty() {
        String::new()
    } else {
        format!("{instance}/")
    }
}

/// The name to read a blob with: `[{instance}/]blobs/...`.
pub fn read_name(instance: &str, d: &Digest) -> String {
    format!("{}{}", instance_prefix(instance), blob_path(d))
}

/// The name to upload a blob with: `[{instance}/]uploads/{upload_id}/blobs/...`, where
/// `upload_id` is new for each upload (a UUID).
pub fn upload_name(instance: &str, upload_id: &str, d: &Digest) -> String {
    format!("{}uploads/{upload_id}/{}", instance_prefix(instance), blob_path(d))
}

/// The subject of a PreconditionFailure MISSING violation for a blob, as REAPI defines
/// it: `blobs/{hash}/{size}`.
pub fn missing_subject(d: &Digest) -> String {
    format!("blobs/{}/{}", d.hash_hex(), d.size)
}

fn shorten(s: &str) -> String {
    if s.len() <= 200 {
        s.to_string()
    } else {
        format!("{}...", &s[..s.char_indices().nth(197).map_or(s.len(), |c| c.0)])
    }
}

fn parse(name: &str) -> Result<ResourceName> {
    let segs: Vec<&str> = name.split('/').collect();
    let first = segs
        .iter()
        .position(|s| RESERVED.contains(s))
        .ok_or_else(|| Error::invalid("no 'blobs', 'compressed-blobs' or 'uploads' segment"))?;
    let instance = segs[..first].join("/");
    if segs[..first].iter().any(|s| s.is_empty()) {
        return Err(Error::invalid(format!("instance name '{instance}' has an empty segment")));
    }
    let mut rest = &segs[first..];
    let mut upload_id = None;
    if rest[0] == "uploads" {
        let id = rest.get(1).copied().unwrap_or("");
        if id.is_empty() || RESERVED.contains(&id) {
            return Err(Error::invalid("missing upload id after 'uploads/'"));
        }
        upload_id = Some(id.to_string());
        rest = &rest[2..];
    }
    let kind = rest.first().copied().unwrap_or("");
    let compressor = match kind {
        "blobs" => {
            rest = &rest[1..];
            Compressor::Identity
        }
        "compressed-blobs" => {
            let c = rest.get(1).copied().unwrap_or("");
            rest = &rest[2.min(rest.len())..];
            match c {
                "zstd" => Compressor::Zstd,
                "identity" => Compressor::Identity,
                "" => return Err(Error::invalid("missing compressor after 'compressed-blobs/'")),
                other => {
                    return Err(Error::invalid(format!("compressor '{other}' is not supported (supported: zstd)")))
                }
            }
        }
        "" => return Err(Error::invalid("missing 'blobs' or 'compressed-blobs' after the upload id")),
        other => return Err(Error::invalid(format!("expected 'blobs' or 'compressed-blobs', found '{other}'"))),
    };
    let mut function = DigestFunction::Sha256;
    if let Some(f) = rest.first().and_then(|s| DigestFunction::from_name(s)) {
        function = f;
        rest = &rest[1..];
    }
    let hash = rest.first().copied().unwrap_or("");
    if hash.is_empty() {
        return Err(Error::invalid("missing hash"));
    }
    let size_str = rest.get(1).copied().ok_or_else(|| Error::invalid("missing size after the hash"))?;
    let size: i64 =
        size_str.parse().map_err(|_| Error::invalid(format!("size '{size_str}' is not a non-negative integer")))?;
    // A compressed resource may not carry trailing metadata; an uncompressed one may.
    if compressor == Compressor::Zstd && rest.len() > 2 {
        return Err(Error::invalid(format!("unexpected trailing segment '{}' after the size", rest[2])));
    }
    let digest = Digest::parse(function, hash, size)?;
    Ok(ResourceName { instance, upload_id, compressor, digest })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_gantry_writes_parse_back() {
        for f in DigestFunction::ALL {
            let d = f.digest_of(b"gantry");
            for inst in ["", "main", "dev/alice"] {
                let r = ResourceName::parse_read(&read_name(inst, &d)).unwrap();
                assert_eq!((r.instance.as_str(), r.digest, r.upload_id), (inst, d, None));
                let w = ResourceName::parse_write(&upload_name(inst, "2b9f6c1e-upload", &d)).unwrap();
                assert_eq!((w.instance.as_str(), w.digest, w.upload_id.as_deref()), (inst, d, Some("2b9f6c1e-upload")));
            }
        }
        let d = DigestFunction::Sha256.digest_of(b"x");
        assert_eq!(missing_subject(&d), format!("blobs/{}/1", d.hash_hex()));
        assert_eq!(read_name("", &d), missing_subject(&d));
    }

    const H: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn read_forms() {
        let r = ResourceName::parse_read(&format!("blobs/{H}/0")).unwrap();
        assert_eq!(r.instance, "");
        assert_eq!(r.compressor, Compressor::Identity);
        assert_eq!(r.digest.hash_hex(), H);
        let r = ResourceName::parse_read(&format!("a/b/blobs/blake3/{H}/12/extra/meta")).unwrap();
        assert_eq!(r.instance, "a/b");
        assert_eq!(r.digest.function, DigestFunction::Blake3);
        assert_eq!(r.digest.size, 12);
        let r = ResourceName::parse_read(&format!("main/compressed-blobs/zstd/{H}/5")).unwrap();
        assert_eq!((r.instance.as_str(), r.compressor), ("main", Compressor::Zstd));
    }

    #[test]
    fn write_forms() {
        let r = ResourceName::parse_write(&format!("inst/uploads/0f0e-uuid/blobs/{H}/7/meta")).unwrap();
        assert_eq!(r.upload_id.as_deref(), Some("0f0e-uuid"));
        assert_eq!(r.instance, "inst");
        let r = ResourceName::parse_write(&format!("uploads/u1/compressed-blobs/zstd/sha256/{H}/7")).unwrap();
        assert_eq!(r.compressor, Compressor::Zstd);
        assert_eq!(r.instance, "");
    }

    #[test]
    fn malformed_names_name_the_offending_part() {
        let cases: Vec<(String, &str)> = vec![
            ("".into(), "no 'blobs'"),
            (format!("x/{H}/1"), "no 'blobs'"),
            ("blobs".into(), "missing hash"),
            (format!("blobs/{H}"), "missing size"),
            (format!("blobs/{H}/-1"), "size_bytes -1 is negative"),
            (format!("blobs/{H}/abc"), "size 'abc'"),
            ("blobs/xyz/1".into(), "3 characters"),
            (format!("blobs/{}/1", "G".repeat(64)), "not lower-case hexadecimal"),
            (format!("compressed-blobs/lz4/{H}/1"), "compressor 'lz4'"),
            (format!("compressed-blobs/zstd/{H}/1/meta"), "trailing segment 'meta'"),
            ("compressed-blobs".into(), "missing compressor"),
            (format!("a//b/blobs/{H}/1"), "empty segment"),
            (format!("uploads/u1/blobs/{H}/1"), "cannot be read"),
        ];
        for (name, want) in cases {
            let e = ResourceName::parse_read(&name).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}");
            assert!(e.to_string().contains(want), "{name}: got '{e}', want '{want}'");
            assert!(e.to_string().contains("resource_name"), "{e}");
        }
        let wcases: Vec<(String, &str)> = vec![
            (format!("blobs/{H}/1"), "a write needs"),
            (format!("uploads/blobs/{H}/1"), "missing upload id"),
            ("uploads/u1".into(), "missing 'blobs'"),
            (format!("uploads/u1/files/{H}/1"), "found 'files'"),
        ];
        for (name, want) in wcases {
            let e = ResourceName::parse_write(&name).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}");
            assert!(e.to_string().contains(want), "{name}: got '{e}', want '{want}'");
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "[a-z0-9/-]{0,120}") {
            let _ = ResourceName::parse_read(&s);
            let _ = ResourceName::parse_write(&s);
        }

        #[test]
        fn never_panics_on_structured_garbage(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just("blobs".to_string()),
                    proptest::strategy::Just("uploads".to_string()),
                    proptest::strategy::Just("compressed-blobs".to_string()),
                    proptest::strategy::Just("zstd".to_string()),
                    proptest::strategy::Just(H.to_string()),
                    "[0-9]{1,3}",
                    ".{0,5}",
                ], 0..8)
        ) {
            let s = parts.join("/");
            let _ = ResourceName::parse_read(&s);
            let _ = ResourceName::parse_write(&s);
        }
    }
}
