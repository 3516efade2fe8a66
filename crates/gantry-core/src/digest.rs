//! Content digests. A `Digest` carries the function that produced it, so two blobs with the
//! same hex string under different functions never alias in a store.

use std::fmt;

use crate::reapi::digest_function::Value as ProtoDigestFunction;
use crate::{reapi, Error, Result};

/// The digest functions gantry accepts. Both produce 32-byte hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DigestFunction {
    Sha256,
    Blake3,
}

impl DigestFunction {
    pub const ALL: [DigestFunction; 2] = [DigestFunction::Sha256, DigestFunction::Blake3];

    /// Maps the REAPI enum. `UNKNOWN` (0) means SHA-256: clients that predate the
    /// `digest_function` fields send nothing and mean SHA-256.
    pub fn from_proto(value: i32) -> Result<Self> {
        match ProtoDigestFunction::try_from(value) {
            Ok(ProtoDigestFunction::Unknown) | Ok(ProtoDigestFunction::Sha256) => Ok(Self::Sha256),
            Ok(ProtoDigestFunction::Blake3) => Ok(Self::Blake3),
            Ok(other) => Err(Error::invalid(format!(
                "digest_function: {} is not supported (supported: sha256, blake3)",
                other.as_str_name()
            ))),
            Err(_) => Err(Error::invalid(format!("digest_function: unknown value {value}"))),
        }
    }

    pub fn to_proto(self) -> i32 {
        match self {
            Self::Sha256 => ProtoDigestFunction::Sha256 as i32,
            Self::Blake3 => ProtoDigestFunction::Blake3 as i32,
        }
    }

    /// Lower-case name, as used in resource names and on disk.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Blake3 => "blake3",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(Self::Sha256),
            "blake3" => Some(Self::Blake3),
            _ => None,
        }
    }

    pub fn hasher(self) -> Hasher {
        match self {
            Self::Sha256 => Hasher::Sha256(Box::default()),
            Self::Blake3 => Hasher::Blake3(Box::default()),
        }
    }

    /// Digest of a whole in-memory buffer.
    pub fn digest_of(self, data: &[u8]) -> Digest {
        let mut h = self.hasher();
        h.update(data);
        h.finish()
    }

    /// The digest of the empty blob, which every CAS holds implicitly.
    pub fn empty(self) -> Digest {
        self.digest_of(&[])
    }
}

/// Incremental hasher for either supported function; counts bytes as it goes.
pub enum Hasher {
    Sha256(Box<(sha2::Sha256, u64)>),
    Blake3(Box<(blake3::Hasher, u64)>),
}

impl Hasher {
    pub fn update(&mut self, data: &[u8]) {
        use sha2::Digest as _;
        match self {
            Hasher::Sha256(h) => {
                h.0.update(data);
                h.1 += data.len() as u64;
            }
            Hasher::Blake3(h) => {
                h.0.update(data);
                h.1 += data.len() as u64;
            }
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            Hasher::Sha256(h) => h.1,
            Hasher::Blake3(h) => h.1,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn finish(self) -> Digest {
        use sha2::Digest as _;
        match self {
            Hasher::Sha256(h) => {
                let (h, n) = *h;
                Digest { function: DigestFunction::Sha256, hash: h.finalize().into(), size: n }
            }
            Hasher::Blake3(h) => {
                let (h, n) = *h;
                Digest { function: DigestFunction::Blake3, hash: *h.finalize().as_bytes(), size: n }
            }
        }
    }
}

/// A blob's identity: the function, its 32-byte hash and its size in bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    pub function: DigestFunction,
    pub hash: [u8; 32],
    pub size: u64,
}

impl Digest {
    /// Parses a hex hash and a size. Errors name the part that is wrong.
    pub fn parse(function: DigestFunction, hash_hex: &str, size: i64) -> Result<Self> {
        if hash_hex.len() != 64 {
            return Err(Error::invalid(format!(
                "hash '{}' has {} characters, {} needs 64 lower-case hex digits",
                truncate(hash_hex),
                hash_hex.len(),
                function.name()
            )));
        }
        if hash_hex.bytes().any(|b| !matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(Error::invalid(format!("hash '{}' is not lower-case hexadecimal", truncate(hash_hex))));
        }
        if size < 0 {
            return Err(Error::invalid(format!("size_bytes {size} is negative")));
        }
        let mut hash = [0u8; 32];
        hex::decode_to_slice(hash_hex, &mut hash).map_err(|e| Error::invalid(format!("hash: {e}")))?;
        Ok(Digest { function, hash, size: size as u64 })
    }

    /// Converts a REAPI `Digest` field; `field` names it in errors ("blob_digests[3]").
    pub fn from_proto(function: DigestFunction, d: Option<&reapi::Digest>, field: &str) -> Result<Self> {
        let d = d.ok_or_else(|| Error::invalid(format!("{field}: missing digest")))?;
        Self::parse(function, &d.hash, d.size_bytes).map_err(|e| e.context(field))
    }

    pub fn to_proto(&self) -> reapi::Digest {
        reapi::Digest { hash: self.hash_hex(), size_bytes: self.size as i64 }
    }

    pub fn hash_hex(&self) -> String {
        self.hex_buf().as_str().to_owned()
    }

    /// The hash in lower-case hex, on the stack. `hex::encode` builds its string one
    /// `char` at a time through an iterator; digests are formatted on every record, proto
    /// and log line, where that was a twentieth of a scheduled action's cost.
    fn hex_buf(&self) -> HexBuf {
        let mut b = [0u8; 64];
        hex::encode_to_slice(self.hash, &mut b).expect("32 bytes make 64 hex digits");
        HexBuf(b)
    }

    pub fn is_empty_blob(&self) -> bool {
        self.size == 0 && *self == self.function.empty()
    }
}

fn truncate(s: &str) -> String {
    if s.len() > 80 {
        format!("{}...", &s[..s.char_indices().nth(77).map_or(s.len(), |c| c.0)])
    } else {
        s.to_string()
    }
}

/// A digest's hash in hex, without an allocation.
struct HexBuf([u8; 64]);

impl HexBuf {
    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl fmt::Display for Digest {
    /// `{hash}/{size}`, made on the stack and written at once: `to_string` (every
    /// execution record has one) then allocates once, at its length, where writing it in
    /// three pieces grew the string four times.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut b = [0u8; 64 + 1 + 20];
        b[..64].copy_from_slice(&self.hex_buf().0);
        b[64] = b'/';
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(self.size).as_bytes();
        let len = 65 + digits.len();
        b[65..len].copy_from_slice(digits);
        // `write_str`, not `pad`: a digest is written whole, whatever width or precision
        // a format string asks for, as it always was.
        f.write_str(std::str::from_utf8(&b[..len]).expect("hex digits, a slash and decimal digits are ASCII"))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.function.name(), self.hex_buf().as_str(), self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn a_digest_displays_as_hash_slash_size_at_every_size() {
        let d = DigestFunction::Sha256.digest_of(b"x");
        for size in [0, 1, 9, 10, 99, 100, 12_345, u32::MAX as u64, u64::MAX] {
            let d = Digest { size, ..d };
            assert_eq!(d.to_string(), format!("{}/{size}", d.hash_hex()));
        }
        // Written whole: neither a width nor a precision cuts or pads it.
        let d7 = Digest { size: 7, ..d };
        assert_eq!(format!("{d7:>70}|{d7:.8}"), format!("{}/7|{}/7", d.hash_hex(), d.hash_hex()));
    }

    #[test]
    fn known_digests() {
        assert_eq!(DigestFunction::Sha256.empty().hash_hex(), EMPTY_SHA256);
        assert_eq!(
            DigestFunction::Blake3.digest_of(b"").hash_hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
        let d = DigestFunction::Sha256.digest_of(b"abc");
        assert_eq!(d.hash_hex(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(d.size, 3);
    }

    #[test]
    fn parse_accepts_valid_and_round_trips() {
        let d = Digest::parse(DigestFunction::Sha256, EMPTY_SHA256, 0).unwrap();
        assert!(d.is_empty_blob());
        assert_eq!(d.to_string(), format!("{EMPTY_SHA256}/0"));
        let p = d.to_proto();
        assert_eq!(Digest::from_proto(DigestFunction::Sha256, Some(&p), "x").unwrap(), d);
    }

    #[test]
    fn parse_rejects_with_precise_messages() {
        let e = Digest::parse(DigestFunction::Sha256, "abc", 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("3 characters"), "{e}");
        let upper = EMPTY_SHA256.to_uppercase();
        let e = Digest::parse(DigestFunction::Sha256, &upper, 0).unwrap_err();
        assert!(e.to_string().contains("not lower-case hexadecimal"), "{e}");
        let e = Digest::parse(DigestFunction::Sha256, EMPTY_SHA256, -1).unwrap_err();
        assert!(e.to_string().contains("negative"), "{e}");
        let e = Digest::from_proto(DigestFunction::Sha256, None, "blob_digests[2]").unwrap_err();
        assert!(e.to_string().starts_with("blob_digests[2]"), "{e}");
        let bad = reapi::Digest { hash: "zz".repeat(32), size_bytes: 1 };
        let e = Digest::from_proto(DigestFunction::Sha256, Some(&bad), "action_digest").unwrap_err();
        assert!(e.to_string().starts_with("action_digest: "), "{e}");
    }

    #[test]
    fn digest_function_mapping() {
        assert_eq!(DigestFunction::from_proto(0).unwrap(), DigestFunction::Sha256);
        assert_eq!(DigestFunction::from_proto(DigestFunction::Blake3.to_proto()).unwrap(), DigestFunction::Blake3);
        let md5 = ProtoDigestFunction::Md5 as i32;
        assert!(DigestFunction::from_proto(md5).unwrap_err().to_string().contains("MD5"));
        assert!(DigestFunction::from_proto(999).is_err());
    }

    proptest::proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,80}", n in proptest::num::i64::ANY) {
            let _ = Digest::parse(DigestFunction::Sha256, &s, n);
        }

        #[test]
        fn incremental_equals_whole(data in proptest::collection::vec(0u8.., 0..3000), split in 0usize..3000) {
            for f in DigestFunction::ALL {
                let split = split.min(data.len());
                let mut h = f.hasher();
                h.update(&data[..split]);
                h.update(&data[split..]);
                proptest::prop_assert_eq!(h.finish(), f.digest_of(&data));
            }
        }
    }
}
