//! Small value types shared by every module: size classes, the validated set
//! of available classes, and the wall-clock [`Timestamp`] the pure functions
//! take instead of reading a clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::Error;

/// A worker size class: a positive integer, resources scale with it.
pub type SizeClass = u32;

/// The size classes currently present in the fleet: non-empty, sorted
/// ascending, without duplicates and without zero.
///
/// Selection takes this rather than a raw slice so that "the largest class"
/// and "the smallest class" are always defined.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<SizeClass>", into = "Vec<SizeClass>")]
pub struct SizeClasses(Vec<SizeClass>);

impl SizeClasses {
    /// Validates, sorts and deduplicates `classes`.
    pub fn new(classes: impl IntoIterator<Item = SizeClass>) -> Result<Self, Error> {
        let mut v: Vec<SizeClass> = classes.into_iter().collect();
        if v.is_empty() {
            return Err(Error::NoSizeClasses);
        }
        if v.contains(&0) {
            return Err(Error::ZeroSizeClass);
        }
        v.sort_unstable();
        v.dedup();
        Ok(Self(v))
    }

    /// The largest class: where retries run and the baseline is measured.
    pub fn largest(&self) -> SizeClass {
        // Non-empty by construction.
        self.0[self.0.len() - 1]
    }

    /// The smallest class.
    pub fn smallest(&self) -> SizeClass {
        self.0[0]
    }

    /// Whether `class` is available.
    pub fn contains(&self, class: SizeClass) -> bool {
        self.0.binary_search(&class).is_ok()
    }

    /// Classes in ascending order.
    pub fn as_slice(&self) -> &[SizeClass] {
        &self.0
    }

    /// Classes in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = SizeClass> + '_ {
        self.0.iter().copied()
    }

    /// Number of classes (at least 1).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false; present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl TryFrom<Vec<SizeClass>> for SizeClasses {
    type Error = Error;
    fn try_from(v: Vec<SizeClass>) -> Result<Self, Error> {
        Self::new(v)
    }
}

impl From<SizeClasses> for Vec<SizeClass> {
    fn from(c: SizeClasses) -> Self {
        c.0
    }
}

/// A wall-clock instant in whole milliseconds since the Unix epoch.
///
/// The selection and recording functions take `now` as a parameter (never
/// reading a clock) so they stay pure and the simulator can drive them with
/// simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The instant `ms` milliseconds after the Unix epoch.
    pub const fn from_unix_millis(ms: u64) -> Self {
        Self(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn unix_millis(self) -> u64 {
        self.0
    }

    /// Converts a `SystemTime`; instants before the epoch map to the epoch.
    pub fn from_system_time(t: SystemTime) -> Self {
        let ms = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        Self(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// `self + d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Self {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Self(self.0.saturating_add(ms))
    }

    /// Time elapsed from `earlier` to `self`; zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

/// Serde helpers that write a `Duration` as floating-point seconds, the unit
/// people write in config files.
pub(crate) mod secs_f64 {
    use std::time::Duration;

    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(|e| D::Error::custom(format!("{secs} s: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_are_sorted_and_deduplicated() {
        let c = SizeClasses::new([8, 1, 4, 2, 4]).unwrap();
        assert_eq!(c.as_slice(), &[1, 2, 4, 8]);
        assert_eq!(c.largest(), 8);
        assert_eq!(c.smallest(), 1);
        assert!(c.contains(4));
        assert!(!c.contains(3));
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn size_classes_reject_empty_and_zero() {
        assert_eq!(SizeClasses::new([]), Err(Error::NoSizeClasses));
        assert_eq!(SizeClasses::new([1, 0]), Err(Error::ZeroSizeClass));
        let r: Result<SizeClasses, _> = serde_json::from_str("[0, 2]");
        assert!(r.is_err());
        let ok: SizeClasses = serde_json::from_str("[4, 2]").unwrap();
        assert_eq!(ok.as_slice(), &[2, 4]);
    }

    #[test]
    fn timestamp_arithmetic_saturates() {
        let t = Timestamp::from_unix_millis(1_000);
        assert_eq!(t.saturating_add(Duration::from_millis(500)).unix_millis(), 1_500);
        assert_eq!(t.saturating_since(Timestamp::from_unix_millis(400)), Duration::from_millis(600));
        assert_eq!(t.saturating_since(Timestamp::from_unix_millis(5_000)), Duration::ZERO);
        let st = UNIX_EPOCH + Duration::from_millis(1234);
        assert_eq!(Timestamp::from_system_time(st).unix_millis(), 1234);
    }
}
