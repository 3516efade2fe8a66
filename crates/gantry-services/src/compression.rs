//! zstd for `compressed-blobs/zstd` resources and compressed batch entries. Streaming
//! (de)compression keeps memory bounded however large the blob.

use bytes::Bytes;
use gantry_core::{Error, Result};
use zstd::stream::raw::{Decoder, Encoder, InBuffer, Operation, OutBuffer};

const OUT_CHUNK: usize = 256 << 10;

/// Incremental zstd decompressor for an upload that arrives in chunks.
pub struct StreamDecoder {
    dec: Decoder<'static>,
    /// Whether the last input ended exactly at the end of a frame.
    frame_done: bool,
}

impl StreamDecoder {
    pub fn new() -> Result<Self> {
        Ok(StreamDecoder {
            dec: Decoder::new().map_err(|e| Error::internal(format!("zstd decoder: {e}")))?,
            frame_done: false,
        })
    }

    /// Decompresses one chunk of compressed input into zero or more output chunks,
    /// refusing to produce more than `budget` bytes: a few KiB of crafted zstd can expand
    /// ~32,000x, so the declared blob size is enforced while decompressing, not after.
    pub fn feed(&mut self, input: &[u8], budget: u64) -> Result<Vec<Bytes>> {
        let mut out_chunks = Vec::new();
        let mut produced_total = 0u64;
        let mut inb = InBuffer::around(input);
        loop {
            let before = inb.pos();
            let mut out = vec![0u8; OUT_CHUNK];
            let mut outb = OutBuffer::around(&mut out[..]);
            let hint =
                self.dec.run(&mut inb, &mut outb).map_err(|e| Error::invalid(format!("zstd data is corrupt: {e}")))?;
            let produced = outb.pos();
            // A call that consumed and produced nothing says nothing about frame state:
            // after a frame ends, zstd reports the next header as wanted.
            if produced > 0 || inb.pos() > before {
                self.frame_done = hint == 0;
            }
            produced_total += produced as u64;
            if produced_total > budget {
                return Err(Error::invalid(format!(
                    "zstd data decompresses to more than the {budget} bytes the digest leaves room for"
                )));
            }
            if produced > 0 {
                out.truncate(produced);
                out_chunks.push(Bytes::from(out));
            }
            // Keep going while input remains or the output buffer filled up (more may be buffered).
            if inb.pos() >= input.len() && produced < OUT_CHUNK {
                break;
            }
        }
        Ok(out_chunks)
    }

    /// Errors if the compressed stream stopped in the middle of a frame.
    pub fn finish(&self) -> Result<()> {
        if self.frame_done {
            Ok(())
        } else {
            Err(Error::invalid("zstd data ends in the middle of a frame"))
        }
    }
}

/// Incremental zstd compressor for a download.
pub struct StreamEncoder {
    enc: Encoder<'static>,
}

impl StreamEncoder {
    pub fn new() -> Result<Self> {
        // Level 1: blobs are usually already dense; speed matters more than ratio here.
        Ok(StreamEncoder { enc: Encoder::new(1).map_err(|e| Error::internal(format!("zstd encoder: {e}")))? })
    }

    pub fn feed(&mut self, input: &[u8]) -> Result<Vec<u8>> {
        let mut result = Vec::new();
        let mut inb = InBuffer::around(input);
        while inb.pos() < input.len() {
            let mut out = vec![0u8; OUT_CHUNK];
            let mut outb = OutBuffer::around(&mut out[..]);
            self.enc.run(&mut inb, &mut outb).map_err(|e| Error::internal(format!("zstd: {e}")))?;
            let n = outb.pos();
            result.extend_from_slice(&out[..n]);
        }
        Ok(result)
    }

    pub fn finish(&mut self) -> Result<Vec<u8>> {
        let mut result = Vec::new();
        loop {
            let mut out = vec![0u8; OUT_CHUNK];
            let mut outb = OutBuffer::around(&mut out[..]);
            let remaining = self.enc.finish(&mut outb, true).map_err(|e| Error::internal(format!("zstd: {e}")))?;
            let n = outb.pos();
            result.extend_from_slice(&out[..n]);
            if remaining == 0 {
                return Ok(result);
            }
        }
    }
}

pub fn compress(data: &[u8]) -> Result<Vec<u8>> {
    zstd::bulk::compress(data, 1).map_err(|e| Error::internal(format!("zstd: {e}")))
}

/// Decompresses a whole buffer, refusing output beyond `expected_size` (a zip bomb guard).
pub fn decompress(data: &[u8], expected_size: u64) -> Result<Vec<u8>> {
    zstd::bulk::decompress(data, expected_size as usize)
        .map_err(|e| Error::invalid(format!("zstd data is corrupt or larger than the digest's size: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_end_on_an_output_buffer_boundary_is_complete() {
        // 1 MiB of zeros decompresses in exactly four full 256 KiB output buffers; the
        // extra empty call after the last one must not un-finish the frame.
        let data = vec![0u8; 1 << 20];
        let c = compress(&data).unwrap();
        let mut dec = StreamDecoder::new().unwrap();
        let out: usize = dec.feed(&c, 1 << 20).unwrap().iter().map(|b| b.len()).sum();
        assert_eq!(out, 1 << 20);
        dec.finish().unwrap();
        // a trailing empty message (finish_write with no data) changes nothing
        assert!(dec.feed(&[], 0).unwrap().is_empty());
        dec.finish().unwrap();
    }

    #[test]
    fn decompression_stops_at_the_budget() {
        let bomb = compress(&vec![0u8; 64 << 20]).unwrap();
        assert!(bomb.len() < 1 << 20);
        let mut dec = StreamDecoder::new().unwrap();
        let e = dec.feed(&bomb, 1000).unwrap_err();
        assert!(e.to_string().contains("1000 bytes"), "{e}");
    }

    #[test]
    fn streaming_round_trip_any_chunking() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8 ^ (i / 7000) as u8).collect();
        let mut enc = StreamEncoder::new().unwrap();
        let mut compressed = Vec::new();
        for c in data.chunks(100_000) {
            compressed.extend(enc.feed(c).unwrap());
        }
        compressed.extend(enc.finish().unwrap());
        assert!(compressed.len() < data.len());
        assert_eq!(decompress(&compressed, data.len() as u64).unwrap(), data);
        for chunk in [1usize, 7, 4096, 1 << 20] {
            let mut dec = StreamDecoder::new().unwrap();
            let mut out = Vec::new();
            for c in compressed.chunks(chunk) {
                for o in dec.feed(c, u64::MAX).unwrap() {
                    out.extend_from_slice(&o);
                }
            }
            dec.finish().unwrap();
            assert_eq!(out.len(), data.len(), "chunk {chunk}");
            assert!(out == data);
        }
    }

    #[test]
    fn truncated_and_corrupt_input_are_rejected() {
        let c = compress(&vec![5u8; 100_000]).unwrap();
        let mut dec = StreamDecoder::new().unwrap();
        dec.feed(&c[..c.len() / 2], u64::MAX).unwrap();
        assert!(dec.finish().is_err());
        let mut dec = StreamDecoder::new().unwrap();
        assert!(dec.feed(b"definitely not zstd", u64::MAX).is_err());
        assert!(decompress(&c, 10).is_err(), "output beyond the declared size is refused");
    }
}
