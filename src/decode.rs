//! Decode: WAV bytes -> mono waveform at `sample_rate`, padded or trimmed to `num_samples`
//! (docs/design.md, "What a row is"). Every malformed input is a [`DecodeError`] that
//! says what is wrong; nothing here panics or allocates more than the input justifies.
//!
//! Supported: PCM 8 (unsigned), 16, 24 and 32-bit, IEEE float 32 and 64-bit, plain or as
//! WAVE_FORMAT_EXTENSIBLE, 1 to [`MAX_CHANNELS`] channels, [`MIN_SAMPLE_RATE`] to
//! [`MAX_SAMPLE_RATE`] Hz. Not supported: A-law, mu-law, ADPCM and other compressed encodings,
//! big-endian RIFX and 64-bit RF64 containers. The fmt chunk's byte rate is not checked
//! (writers often get it wrong and nothing here needs it).

use rubato::Resampler as _;

/// A decoded recording, ready to featurise: mono, at the configured sample rate, exactly
/// `num_samples` long. 16-bit mono PCM at the target rate stays integer (the GPU path uploads
/// int16, half the bytes); everything else is float in [-1, 1).
#[derive(Debug, Clone, PartialEq)]
pub enum Waveform {
    /// Integer samples; the value is `s / 32768`.
    Pcm16(Vec<i16>),
    Float(Vec<f32>),
}

/// Sample buffers handed back once a recording is featurised ([`Waveform::recycle`]), so the
/// next decode writes into pages already mapped: a fresh 80 KB buffer per file costs the
/// kernel's zeroing of its pages, more than the decode itself (the rebuild profile showed the
/// page clearing at 40% of its CPU time).
mod buffers {
    use std::sync::Mutex;

    /// Samples the kept buffers may hold in all: 128 MB, about three bulk batches of 10 s clips
    /// (80 KB each). A buffer that does not fit (after files far longer than a clip) is freed.
    const KEEP_SAMPLES: usize = 64 << 20;

    /// The kept buffers, and the samples they can hold.
    static FREE: Mutex<(Vec<Vec<i16>>, usize)> = Mutex::new((Vec::new(), 0));

    /// An empty buffer with room for `len` samples.
    pub fn take(len: usize) -> Vec<i16> {
        let kept = FREE
            .lock()
            .map(|mut f| {
                let v = f.0.pop();
                f.1 -= v.as_ref().map_or(0, Vec::capacity);
                v
            })
            .unwrap_or(None);
        match kept {
            Some(mut v) => {
                v.clear();
                v.reserve(len);
                v
            }
            None => Vec::with_capacity(len),
        }
    }

    pub fn give(v: Vec<i16>) {
        if let Ok(mut free) = FREE.lock() {
            if free.1 + v.capacity() <= KEEP_SAMPLES {
                free.1 += v.capacity();
                free.0.push(v);
            }
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_pool_keeps_a_bounded_amount() {
            super::give(Vec::with_capacity(super::KEEP_SAMPLES + 1));
            for _ in 0..4 {
                super::give(Vec::with_capacity(super::KEEP_SAMPLES / 3));
            }
            let kept = super::FREE.lock().unwrap();
            assert!(kept.1 <= super::KEEP_SAMPLES);
            assert_eq!(kept.1, kept.0.iter().map(Vec::capacity).sum::<usize>());
        }
    }
}

/// A file's bytes, read into a sample buffer of the pool ([`buffers`]): a 16-bit mono file at
/// the target rate then becomes its waveform in place ([`FileBytes::decode`]), its samples moved
/// down over the header, instead of being copied out of a read buffer into a sample buffer.
/// Dropped undecoded, the buffer goes back to the pool.
pub struct FileBytes {
    buf: Vec<i16>,
    len: usize,
}

impl FileBytes {
    /// Read `file` from its current position to its end, at most `limit` bytes.
    pub fn read(file: &std::fs::File, limit: u64) -> std::io::Result<FileBytes> {
        use std::os::fd::AsRawFd;
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let mut buf = buffers::take(limit.div_ceil(2));
        let ptr = buf.as_mut_ptr().cast::<u8>();
        let mut len = 0usize;
        while len < limit {
            // SAFETY: `buf` has room for `limit` bytes (its capacity is at least limit / 2
            // rounded up, in i16), and `read` writes at most `limit - len` bytes from `len`.
            let n = unsafe {
                libc::read(
                    file.as_raw_fd(),
                    ptr.add(len).cast(),
                    (limit - len).min(isize::MAX as usize),
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                buffers::give(buf);
                return Err(e);
            }
            if n == 0 {
                break;
            }
            len += n as usize;
        }
        if len % 2 == 1 {
            // SAFETY: within the capacity (see above); the last sample's other byte is set so
            // that every element below the new length is initialised.
            unsafe { ptr.add(len).write(0) };
        }
        // SAFETY: the first `len` bytes were written by `read`, and the odd one just above.
        unsafe { buf.set_len(len.div_ceil(2)) };
        Ok(FileBytes { buf, len })
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.buf)[..self.len]
    }

    /// [`decode`] of these bytes; the fast path (16-bit mono at `sample_rate`) keeps the buffer
    /// as the waveform.
    pub fn decode(mut self, sample_rate: u32, num_samples: usize) -> Result<Waveform, DecodeError> {
        let info = parse_header(self.bytes())?;
        // RIFF pads chunks to even sizes, so the samples start at an even offset: whole i16s.
        if !info.is_waveform_at(sample_rate) || info.data_offset % 2 != 0 {
            return decode_parsed(self.bytes(), &info, sample_rate, num_samples);
        }
        let mut samples = std::mem::take(&mut self.buf);
        let start = info.data_offset / 2;
        let n = num_samples.min(info.data_len / 2);
        samples.copy_within(start..start + n, 0);
        samples.truncate(n);
        if cfg!(target_endian = "big") {
            for s in samples.iter_mut() {
                *s = i16::from_le(*s);
            }
        }
        samples.resize(num_samples, 0);
        Ok(Waveform::Pcm16(samples))
    }
}

impl Drop for FileBytes {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.capacity() > 0 {
            buffers::give(buf);
        }
    }
}

impl Default for Waveform {
    fn default() -> Self {
        Waveform::Float(Vec::new())
    }
}

impl Waveform {
    /// Hand the samples' buffer back for the next decode (see [`buffers`]).
    pub fn recycle(self) {
        if let Waveform::Pcm16(v) = self {
            if v.capacity() > 0 {
                buffers::give(v);
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Waveform::Pcm16(v) => v.len(),
            Waveform::Float(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sample i as float in [-1, 1).
    #[inline]
    pub fn sample(&self, i: usize) -> f32 {
        match self {
            Waveform::Pcm16(v) => v[i] as f32 * (1.0 / 32768.0),
            Waveform::Float(v) => v[i],
        }
    }
    /// Copy samples `start..start + dst.len()` into `dst` as float.
    pub fn copy_to_f32(&self, start: usize, dst: &mut [f32]) {
        match self {
            Waveform::Pcm16(v) => {
                let n = dst.len();
                for (d, s) in dst.iter_mut().zip(&v[start..start + n]) {
                    *d = *s as f32 * (1.0 / 32768.0);
                }
            }
            Waveform::Float(v) => dst.copy_from_slice(&v[start..start + dst.len()]),
        }
    }
}

/// More channels than this is a corrupt header, not a hydrophone.
pub const MAX_CHANNELS: u16 = 64;
/// Sample rates outside this range are corrupt headers; inside it the resampler's cost and
/// memory stay bounded: its FFT sizes grow with `rate / gcd(rate, sample_rate)`, at worst
/// (383 993 Hz, coprime with 4096) about 60 MB and 0.3 s per recording.
pub const MIN_SAMPLE_RATE: u32 = 100;
pub const MAX_SAMPLE_RATE: u32 = 384_000;

const WAVE_FORMAT_PCM: u16 = 1;
const WAVE_FORMAT_IEEE_FLOAT: u16 = 3;
const WAVE_FORMAT_EXTENSIBLE: u16 = 0xFFFE;
/// Bytes 2..16 of every standard KSDATAFORMAT_SUBTYPE GUID; bytes 0..2 are the format tag.
const SUBFORMAT_GUID_TAIL: [u8; 14] = [
    0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x80, 0x00, 0x00, 0xAA, 0x00, 0x38, 0x9B, 0x71,
];

/// A RIFF chunk id as it appears in the file; shown trimmed and escaped in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkId(pub [u8; 4]);

impl std::fmt::Display for ChunkId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let trimmed = self.0.trim_ascii_end();
        for &b in if trimmed.is_empty() {
            &self.0[..]
        } else {
            trimmed
        } {
            if b.is_ascii_graphic() || b == b' ' {
                write!(f, "{}", b as char)?;
            } else {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

/// Why a recording cannot be decoded. The message is meant for an operator reading a quarantine
/// reason; [`DecodeError::is_incomplete`] tells a caller whether waiting might help.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty file (0 bytes)")]
    Empty,
    #[error("not a WAV file (no RIFF/WAVE header)")]
    NotWav,
    #[error("unsupported container: {0}; only little-endian RIFF/WAVE is supported")]
    UnsupportedContainer(&'static str),
    #[error("recording in progress: RIFF/data sizes are placeholders (0 or 0xFFFFFFFF)")]
    PlaceholderSizes,
    #[error(
        "recording in progress: the header declares {declared} data bytes and the RIFF ends \
         there, but {present} bytes follow the data chunk header; the recorder has not \
         finalised the header"
    )]
    StaleHeader { declared: u32, present: usize },
    #[error("truncated: {chunk} chunk declares {declared} bytes but only {present} are present")]
    Truncated {
        chunk: ChunkId,
        declared: u64,
        present: usize,
    },
    #[error("truncated: the file ends at byte {file_len}, inside the header of a chunk")]
    TruncatedChunkHeader { file_len: usize },
    #[error("chunk `{chunk}` claims {size} bytes, more than the file ({file_len} bytes)")]
    ChunkTooLarge {
        chunk: ChunkId,
        size: u32,
        file_len: usize,
    },
    #[error("no fmt chunk before the data chunk")]
    NoFmt,
    #[error("fmt chunk is {size} bytes; this encoding needs at least {needed}")]
    FmtTooShort { size: u32, needed: u32 },
    #[error("fmt declares 0 channels")]
    ZeroChannels,
    #[error("fmt declares {0} channels; at most {MAX_CHANNELS} are supported")]
    TooManyChannels(u16),
    #[error("fmt declares a sample rate of 0 Hz")]
    ZeroSampleRate,
    #[error(
        "fmt declares a sample rate of {0} Hz; supported rates are {MIN_SAMPLE_RATE} to \
         {MAX_SAMPLE_RATE} Hz"
    )]
    SampleRateOutOfRange(u32),
    #[error(
        "unsupported encoding: {} (format tag {tag}); only PCM 8/16/24/32-bit and IEEE float \
         32/64-bit are supported",
        encoding_name(*tag, *bits)
    )]
    UnsupportedEncoding { tag: u16, bits: u16 },
    #[error(
        "unsupported encoding: WAVE_FORMAT_EXTENSIBLE with a non-standard sub-format GUID \
         starting {:02x}{:02x}; only PCM and IEEE float are supported",
        .0[0], .0[1]
    )]
    UnknownSubformat([u8; 16]),
    #[error(
        "fmt declares block_align {block_align}, but {channels} channels of {bits} bits need \
         {expected}"
    )]
    BlockAlign {
        block_align: u16,
        channels: u16,
        bits: u16,
        expected: u32,
    },
    #[error("no data chunk")]
    NoData,
    #[error("no audio frames: the data chunk is empty")]
    NoFrames,
    #[error("data chunk is {data_len} bytes, not a whole number of {block_align}-byte frames")]
    PartialFrame { data_len: u32, block_align: u16 },
    #[error("float sample at frame {frame} is not a finite number (NaN or infinity)")]
    NonFinite { frame: usize },
    #[error("cannot resample from {from} Hz to {to} Hz: {reason}")]
    Resample { from: u32, to: u32, reason: String },
}

impl DecodeError {
    /// True when the file may simply not be fully written yet (placeholder sizes, a header that
    /// lags the data, fewer bytes than declared): a watcher should wait for it to settle before
    /// quarantining it with this reason.
    pub fn is_incomplete(&self) -> bool {
        matches!(
            self,
            DecodeError::PlaceholderSizes
                | DecodeError::StaleHeader { .. }
                | DecodeError::Truncated { .. }
                | DecodeError::TruncatedChunkHeader { .. }
        )
    }
}

fn encoding_name(tag: u16, bits: u16) -> String {
    match tag {
        WAVE_FORMAT_PCM => format!("{bits}-bit PCM"),
        WAVE_FORMAT_IEEE_FLOAT => format!("{bits}-bit IEEE float"),
        0x0002 => "Microsoft ADPCM".into(),
        0x0006 => "A-law".into(),
        0x0007 => "mu-law".into(),
        0x0011 => "IMA ADPCM".into(),
        0x0031 => "GSM 6.10".into(),
        0x0050 => "MPEG".into(),
        0x0055 => "MPEG layer 3".into(),
        0x1610 => "AAC".into(),
        0xF1AC => "FLAC".into(),
        _ => "unknown encoding".into(),
    }
}

/// How the samples in the data chunk are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleFormat {
    /// 8-bit unsigned, 128 is zero.
    PcmU8,
    Pcm16,
    /// 24-bit little-endian, packed in 3 bytes.
    Pcm24,
    Pcm32,
    Float32,
    Float64,
}

impl SampleFormat {
    fn from_tag(tag: u16, bits: u16) -> Result<SampleFormat, DecodeError> {
        match (tag, bits) {
            (WAVE_FORMAT_PCM, 8) => Ok(SampleFormat::PcmU8),
            (WAVE_FORMAT_PCM, 16) => Ok(SampleFormat::Pcm16),
            (WAVE_FORMAT_PCM, 24) => Ok(SampleFormat::Pcm24),
            (WAVE_FORMAT_PCM, 32) => Ok(SampleFormat::Pcm32),
            (WAVE_FORMAT_IEEE_FLOAT, 32) => Ok(SampleFormat::Float32),
            (WAVE_FORMAT_IEEE_FLOAT, 64) => Ok(SampleFormat::Float64),
            _ => Err(DecodeError::UnsupportedEncoding { tag, bits }),
        }
    }
}

/// What the header says, checked against the bytes actually present: when
/// [`parse_header`] returns this, `bytes[data_offset..data_offset + data_len]` exists and holds
/// exactly `frames` whole frames.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WavInfo {
    pub format: SampleFormat,
    pub channels: u16,
    pub sample_rate: u32,
    pub bits_per_sample: u16,
    /// Bytes per frame (all channels of one sample instant).
    pub block_align: u16,
    /// Where the data chunk's samples start in the file.
    pub data_offset: usize,
    /// Length of the data chunk's samples in bytes.
    pub data_len: usize,
    pub frames: usize,
}

impl WavInfo {
    /// 16-bit mono at `sample_rate`: the data chunk is the waveform as it is
    /// ([`Waveform::Pcm16`]), nothing to mix or resample.
    fn is_waveform_at(&self, sample_rate: u32) -> bool {
        self.sample_rate == sample_rate && self.format == SampleFormat::Pcm16 && self.channels == 1
    }
}

/// The parts of the fmt chunk that matter, already validated.
struct Fmt {
    format: SampleFormat,
    channels: u16,
    sample_rate: u32,
    bits_per_sample: u16,
    block_align: u16,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `body` is the start of the fmt chunk's body (at least its first 40 bytes, or all of it when
/// shorter); `size` is the size the chunk declares.
fn parse_fmt(body: &[u8], size: u32) -> Result<Fmt, DecodeError> {
    if size < 16 {
        return Err(DecodeError::FmtTooShort { size, needed: 16 });
    }
    let mut tag = u16_at(body, 0);
    let channels = u16_at(body, 2);
    let sample_rate = u32_at(body, 4);
    let block_align = u16_at(body, 12);
    let bits = u16_at(body, 14);
    if tag == WAVE_FORMAT_EXTENSIBLE {
        // cbSize, valid bits and channel mask (16..24) do not change how samples are read:
        // valid bits < container bits still means left-justified samples.
        if size < 40 {
            return Err(DecodeError::FmtTooShort { size, needed: 40 });
        }
        let mut guid = [0u8; 16];
        guid.copy_from_slice(&body[24..40]);
        if guid[2..] != SUBFORMAT_GUID_TAIL {
            return Err(DecodeError::UnknownSubformat(guid));
        }
        tag = u16::from_le_bytes([guid[0], guid[1]]);
    }
    if channels == 0 {
        return Err(DecodeError::ZeroChannels);
    }
    if channels > MAX_CHANNELS {
        return Err(DecodeError::TooManyChannels(channels));
    }
    if sample_rate == 0 {
        return Err(DecodeError::ZeroSampleRate);
    }
    if !(MIN_SAMPLE_RATE..=MAX_SAMPLE_RATE).contains(&sample_rate) {
        return Err(DecodeError::SampleRateOutOfRange(sample_rate));
    }
    let format = SampleFormat::from_tag(tag, bits)?;
    let expected = u32::from(channels) * u32::from(bits / 8);
    if u32::from(block_align) != expected {
        return Err(DecodeError::BlockAlign {
            block_align,
            channels,
            bits,
            expected,
        });
    }
    Ok(Fmt {
        format,
        channels,
        sample_rate,
        bits_per_sample: bits,
        block_align,
    })
}

/// Bytes of the fmt chunk's body that [`parse_fmt`] looks at.
const FMT_LOOKED_AT: usize = 40;

/// The bytes the header parser looks at: a whole file in memory, or a file on disk of which
/// only the parts looked at are read ([`parse_file_header`]).
trait Source {
    type Error;
    /// The file's length.
    fn len(&self) -> u64;
    /// The bytes from `at`, at most `n` (fewer at the end of the file).
    fn get(&self, at: u64, n: usize) -> Result<std::borrow::Cow<'_, [u8]>, Self::Error>;
}

impl Source for [u8] {
    type Error = std::convert::Infallible;
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }
    #[inline]
    fn get(&self, at: u64, n: usize) -> Result<std::borrow::Cow<'_, [u8]>, Self::Error> {
        let len = <[u8]>::len(self);
        let from = usize::try_from(at).unwrap_or(len).min(len);
        Ok(std::borrow::Cow::Borrowed(
            &self[from..from.saturating_add(n).min(len)],
        ))
    }
}

/// A file of `len` bytes, its first bytes read (`head`); the parser's other reads (chunk
/// headers, the fmt chunk, a few bytes after the data) are read where they lie.
struct FileSource<'a> {
    file: &'a std::fs::File,
    len: u64,
    head: Vec<u8>,
}

impl Source for FileSource<'_> {
    type Error = std::io::Error;
    fn len(&self) -> u64 {
        self.len
    }
    fn get(&self, at: u64, n: usize) -> std::io::Result<std::borrow::Cow<'_, [u8]>> {
        use std::os::unix::fs::FileExt;
        let end = at.saturating_add(n as u64).min(self.len);
        if end <= self.head.len() as u64 {
            return Ok(std::borrow::Cow::Borrowed(
                &self.head[at.min(end) as usize..end as usize],
            ));
        }
        let mut buf = vec![0u8; end.saturating_sub(at) as usize];
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], at + done as u64) {
                // The file shrank since its length was taken: what is there is parsed, the
                // rest reads as zeros (the caller notices the change of size).
                Ok(0) => break,
                Ok(k) => done += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(std::borrow::Cow::Owned(buf))
    }
}

/// Bytes read from the start of a file before its header is parsed (the rest of what the parser
/// looks at is read where it lies).
const HEAD_BYTES: u64 = 4096;

/// [`parse_header`] of the file `file`, `len` bytes long, reading only the parts the parser looks
/// at (the chunk headers, the fmt chunk, a few bytes after the audio), never the audio: a few
/// reads whatever the file's size. The outer error is an I/O error.
pub fn parse_file_header(
    file: &std::fs::File,
    len: u64,
) -> std::io::Result<Result<WavInfo, DecodeError>> {
    let mut src = FileSource {
        file,
        len,
        head: Vec::new(),
    };
    src.head = src.get(0, HEAD_BYTES.min(len) as usize)?.into_owned();
    parse_in(&src)
}

/// Why parsing stopped: what the header says is wrong, or the source's own error.
enum Fail<E> {
    Decode(DecodeError),
    Source(E),
}

impl<E> From<DecodeError> for Fail<E> {
    fn from(e: DecodeError) -> Self {
        Fail::Decode(e)
    }
}

/// Whether the bytes from `pos` to the end of the file are a tag that taggers append to audio
/// files of any kind, outside the RIFF: an ID3v2 tag (`ID3`, version 2 to 4, a size in
/// "syncsafe" bytes of 7 bits each; what follows it, up to the end, may be an ID3v1 tag or
/// padding) or an ID3v1 tag (`TAG`, exactly the last 128 bytes). Audio written past a stale
/// header is not told apart from these by a few bytes, so the tag's own size must fit the file.
fn looks_like_tag<S: Source + ?Sized>(src: &S, pos: u64) -> Result<bool, Fail<S::Error>> {
    let left = src.len().saturating_sub(pos);
    if left == 128 {
        return Ok(&src.get(pos, 3).map_err(Fail::Source)?[..] == b"TAG");
    }
    if left < 10 {
        return Ok(false);
    }
    let b = src.get(pos, 10).map_err(Fail::Source)?;
    let syncsafe = b[6..10].iter().all(|&c| c < 0x80);
    if &b[..3] != b"ID3" || !(2..=4).contains(&b[3]) || b[4] == 0xFF || !syncsafe {
        return Ok(false);
    }
    let size = b[6..10].iter().fold(0u64, |n, &c| n << 7 | u64::from(c));
    // A footer (flag 0x10, version 4) repeats the 10-byte header at the tag's end.
    let footer = if b[5] & 0x10 != 0 { 10 } else { 0 };
    Ok(10 + size + footer <= left)
}

/// Whether the bytes at `pos` read as a RIFF chunk header that fits in the file: used to tell
/// metadata appended after the audio from audio written past a header not yet updated.
fn looks_like_chunk<S: Source + ?Sized>(src: &S, pos: u64) -> Result<bool, Fail<S::Error>> {
    let left = src.len().saturating_sub(pos);
    if left < 8 {
        return Ok(false);
    }
    let b = src.get(pos, 8).map_err(Fail::Source)?;
    let id_ok =
        b[0].is_ascii_alphanumeric() && b[1..4].iter().all(|c| c.is_ascii_graphic() || *c == b' ');
    // A missing pad byte after an odd-sized last chunk is a common writer slip; allow it.
    Ok(id_ok && u64::from(u32_at(&b, 4)) <= (left - 8) + 1)
}

/// Parse and check the header against the actual byte length. Used by [`decode`] and by the
/// daemon to tell whether a file still being written is complete ("header consistent with the
/// size"); see [`DecodeError::is_incomplete`].
///
/// Chunks before `data` other than `fmt ` are skipped (word-aligned: an odd size has a pad
/// byte); anything after the data chunk is ignored. Sizes the file cannot back are errors: a
/// chunk reaching past the end of the file but not of the declared RIFF is truncation, one
/// reaching past the RIFF too is a corrupt header.
pub fn parse_header(bytes: &[u8]) -> Result<WavInfo, DecodeError> {
    match parse_in(bytes) {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// [`parse_header`] of any [`Source`]; the outer error is the source's.
fn parse_in<S: Source + ?Sized>(src: &S) -> Result<Result<WavInfo, DecodeError>, S::Error> {
    match parse_source(src) {
        Ok(info) => Ok(Ok(info)),
        Err(Fail::Decode(e)) => Ok(Err(e)),
        Err(Fail::Source(e)) => Err(e),
    }
}

fn parse_source<S: Source + ?Sized>(src: &S) -> Result<WavInfo, Fail<S::Error>> {
    let len64 = src.len();
    // For messages only: lengths beyond usize do not occur on 64-bit hosts.
    let len = usize::try_from(len64).unwrap_or(usize::MAX);
    if len64 == 0 {
        return Err(DecodeError::Empty.into());
    }
    let head = src.get(0, 12).map_err(Fail::Source)?;
    let magic = &head[..head.len().min(4)];
    if len64 < 12 {
        // A recorder that has written only the first bytes of its header.
        return Err(if b"RIFF".starts_with(magic) {
            DecodeError::TruncatedChunkHeader { file_len: len }
        } else {
            DecodeError::NotWav
        }
        .into());
    }
    match (magic, &head[8..12]) {
        (b"RIFF", b"WAVE") => {}
        (b"RIFX", b"WAVE") => {
            return Err(DecodeError::UnsupportedContainer("big-endian RIFX").into())
        }
        (b"RF64", b"WAVE") => return Err(DecodeError::UnsupportedContainer("64-bit RF64").into()),
        _ => return Err(DecodeError::NotWav.into()),
    }
    let riff_size = u32_at(&head, 4);
    if riff_size == 0 || riff_size == u32::MAX {
        return Err(DecodeError::PlaceholderSizes.into());
    }
    // u64 throughout: chunk ends computed from u32 sizes must not wrap on 32-bit targets.
    let riff_end = 8 + u64::from(riff_size);

    let mut fmt = None;
    let mut pos = 12u64;
    loop {
        if pos >= len64 {
            break;
        }
        if pos + 8 > len64 {
            if pos < riff_end {
                return Err(DecodeError::TruncatedChunkHeader { file_len: len }.into());
            }
            break; // a few stray bytes after the RIFF: not ours to judge
        }
        let h = src.get(pos, 8).map_err(Fail::Source)?;
        let chunk = ChunkId([h[0], h[1], h[2], h[3]]);
        let size = u32_at(&h, 4);
        let body = pos + 8;
        let end = body + u64::from(size);
        if &chunk.0 == b"data" {
            let info = fmt.ok_or(DecodeError::NoFmt)?;
            return check_data(src, info, body, size, riff_end);
        }
        if end > len64 {
            if pos >= riff_end {
                break; // bytes past the declared RIFF that do not form a chunk
            }
            return Err(oversized(chunk, size, body, end, riff_end, len).into());
        }
        if &chunk.0 == b"fmt " && fmt.is_none() {
            let b = src
                .get(body, (size as usize).min(FMT_LOOKED_AT))
                .map_err(Fail::Source)?;
            fmt = Some(parse_fmt(&b, size)?);
        }
        pos = end + u64::from(size & 1);
    }
    if riff_end > len64 + 1 {
        return Err(DecodeError::Truncated {
            chunk: ChunkId(*b"RIFF"),
            declared: u64::from(riff_size),
            present: len - 8,
        }
        .into());
    }
    Err(DecodeError::NoData.into())
}

/// A chunk reaching past the end of the file: truncation if the RIFF size says the file should
/// be that long, a corrupt size if not even the RIFF covers it.
fn oversized(
    chunk: ChunkId,
    size: u32,
    body: u64,
    end: u64,
    riff_end: u64,
    len: usize,
) -> DecodeError {
    // +1: the RIFF size of a writer that forgot the final pad byte.
    if end > riff_end + 1 {
        DecodeError::ChunkTooLarge {
            chunk,
            size,
            file_len: len,
        }
    } else {
        DecodeError::Truncated {
            chunk,
            declared: u64::from(size),
            present: len - body as usize,
        }
    }
}

fn check_data<S: Source + ?Sized>(
    src: &S,
    fmt: Fmt,
    body: u64,
    size: u32,
    riff_end: u64,
) -> Result<WavInfo, Fail<S::Error>> {
    let len64 = src.len();
    let len = usize::try_from(len64).unwrap_or(usize::MAX);
    // body <= len: the caller read the 8-byte chunk header before it.
    let after_header = len64 - body;
    if size == u32::MAX || (size == 0 && after_header > 0 && !looks_like_chunk(src, body)?) {
        return Err(DecodeError::PlaceholderSizes.into());
    }
    let end = body + u64::from(size);
    if end > len64 {
        return Err(oversized(ChunkId(*b"data"), size, body, end, riff_end, len).into());
    }
    if size == 0 {
        return Err(DecodeError::NoFrames.into());
    }
    let padded_end = end + u64::from(size & 1);
    if riff_end <= padded_end && padded_end + 1 < len64 {
        // The RIFF ends with the audio, yet more bytes follow: either metadata someone appended
        // without updating the RIFF size (fine), or audio a recorder wrote past a header it
        // updates only now and then (not finished).
        let trailing_ok = looks_like_chunk(src, end)?
            || looks_like_chunk(src, padded_end)?
            || looks_like_tag(src, end)?
            || looks_like_tag(src, padded_end)?;
        if !trailing_ok {
            return Err(DecodeError::StaleHeader {
                declared: size,
                present: usize::try_from(after_header).unwrap_or(usize::MAX),
            }
            .into());
        }
    }
    if riff_end > len64 + 1 {
        // The audio is all there, but the file is shorter than its RIFF size: whatever was to
        // follow the data chunk is still being written or was lost.
        return Err(DecodeError::Truncated {
            chunk: ChunkId(*b"RIFF"),
            declared: riff_end - 8,
            present: len - 8,
        }
        .into());
    }
    if !size.is_multiple_of(u32::from(fmt.block_align)) {
        return Err(DecodeError::PartialFrame {
            data_len: size,
            block_align: fmt.block_align,
        }
        .into());
    }
    let data_len = size as usize;
    Ok(WavInfo {
        format: fmt.format,
        channels: fmt.channels,
        sample_rate: fmt.sample_rate,
        bits_per_sample: fmt.bits_per_sample,
        block_align: fmt.block_align,
        data_offset: body as usize,
        data_len,
        frames: data_len / usize::from(fmt.block_align),
    })
}

/// Decode to mono at `sample_rate`, zero-padded or trimmed to exactly `num_samples`.
///
/// 16-bit mono PCM already at `sample_rate` comes back as [`Waveform::Pcm16`] without
/// conversion (the common case, a copy of the data chunk). Everything else becomes
/// [`Waveform::Float`]: integer PCM divided by 2^(bits-1) (8-bit centred on 128 first), float
/// as stored, channels averaged in f64, then resampled with a band-limited FFT resampler whose
/// delay is removed so sample `i` of the output is at time `i / sample_rate` of the recording.
/// A resampled recording of `frames` frames is `ceil(frames * sample_rate / file_rate)` samples
/// long before padding or trimming. Only the frames that reach the first `num_samples` output
/// samples are converted.
pub fn decode(bytes: &[u8], sample_rate: u32, num_samples: usize) -> Result<Waveform, DecodeError> {
    decode_parsed(bytes, &parse_header(bytes)?, sample_rate, num_samples)
}

/// [`decode`] of `bytes` whose header is `info`.
fn decode_parsed(
    bytes: &[u8],
    info: &WavInfo,
    sample_rate: u32,
    num_samples: usize,
) -> Result<Waveform, DecodeError> {
    let data = &bytes[info.data_offset..info.data_offset + info.data_len];
    if info.is_waveform_at(sample_rate) {
        return Ok(Waveform::Pcm16(pcm16_mono(data, num_samples)));
    }
    if info.sample_rate == sample_rate {
        let mut mono = to_mono(data, info, info.frames.min(num_samples))?;
        mono.resize(num_samples, 0.0);
        return Ok(Waveform::Float(mono));
    }
    let mut resampler = BandLimited::new(info.sample_rate, sample_rate)?;
    let used = resampler.input_needed(num_samples).min(info.frames);
    let mono = to_mono(data, info, used)?;
    let mut out = resampler.run(&mono, info.frames, num_samples)?;
    out.resize(num_samples, 0.0);
    Ok(Waveform::Float(out))
}

/// The fast path: the data chunk is already the waveform. An element-wise loop the compiler
/// vectorises, rather than a memcpy into a cast slice: glibc's memcpy of this unaligned source
/// (`rep movsb`) took 40 us for a 10 s clip on AMD EPYC, this takes 3 us.
fn pcm16_mono(data: &[u8], num_samples: usize) -> Vec<i16> {
    let n = num_samples.min(data.len() / 2);
    let mut out = buffers::take(num_samples);
    out.extend(
        data[..2 * n]
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]])),
    );
    out.resize(num_samples, 0);
    out
}

/// The first `frames` frames of `data` as mono float.
fn to_mono(data: &[u8], info: &WavInfo, frames: usize) -> Result<Vec<f32>, DecodeError> {
    let mut mono = Vec::with_capacity(frames);
    mono_into(
        &data[..frames * usize::from(info.block_align)],
        info,
        &mut mono,
    );
    check_finite(&mono)?;
    Ok(mono)
}

/// Integer formats cannot produce these; a NaN in a float file would poison every row value.
fn check_finite(mono: &[f32]) -> Result<(), DecodeError> {
    match mono.iter().position(|v| !v.is_finite()) {
        Some(frame) => Err(DecodeError::NonFinite { frame }),
        None => Ok(()),
    }
}

/// The whole frames of `data` as mono float, appended to `out`.
fn mono_into(data: &[u8], info: &WavInfo, out: &mut Vec<f32>) {
    let ch = usize::from(info.channels);
    match info.format {
        SampleFormat::PcmU8 => mix(data, ch, |[b]: [u8; 1]| (f64::from(b) - 128.0) / 128.0, out),
        SampleFormat::Pcm16 => mix(
            data,
            ch,
            |b| f64::from(i16::from_le_bytes(b)) / 32768.0,
            out,
        ),
        SampleFormat::Pcm24 => mix(
            data,
            ch,
            |[a, b, c]: [u8; 3]| {
                // Put the 3 bytes in the top of an i32 so the shift sign-extends.
                f64::from(i32::from_le_bytes([0, a, b, c]) >> 8) / 8_388_608.0
            },
            out,
        ),
        SampleFormat::Pcm32 => mix(
            data,
            ch,
            |b| f64::from(i32::from_le_bytes(b)) / 2_147_483_648.0,
            out,
        ),
        SampleFormat::Float32 => mix(data, ch, |b| f64::from(f32::from_le_bytes(b)), out),
        SampleFormat::Float64 => mix(data, ch, f64::from_le_bytes, out),
    }
}

/// Average the channels of each frame of `W`-byte samples, appended to `out`. Summing in f64
/// and dividing once keeps the average exact for every integer format (and matches numpy's
/// `mean(axis=1)`).
fn mix<const W: usize>(
    data: &[u8],
    channels: usize,
    sample: impl Fn([u8; W]) -> f64,
    out: &mut Vec<f32>,
) {
    // chunks_exact(W) yields W bytes, so the conversion never falls back to the default.
    let read = |c: &[u8]| sample(c.try_into().unwrap_or([0; W]));
    if channels == 1 {
        out.extend(data.chunks_exact(W).map(|c| read(c) as f32));
        return;
    }
    let n = channels as f64;
    out.extend(
        data.chunks_exact(W * channels)
            .map(|frame| (frame.chunks_exact(W).map(read).sum::<f64>() / n) as f32),
    );
}

/// Bytes read at a time by [`stream_file`]: what it holds of a file, whatever the file's size.
pub const STREAM_PIECE: usize = 256 << 10;

/// What one pass over a file gave ([`stream_file`]).
#[derive(Debug)]
pub enum Streamed {
    /// The header says what is wrong with the file: nothing past the header was read, so there
    /// is no content hash.
    BadHeader(DecodeError),
    /// Read to its end: `len` bytes (the length it had when the pass ended), their blake3, the
    /// header, and the row's samples decoded as [`decode`] does, or why not.
    Read {
        len: u64,
        hash: [u8; 32],
        info: WavInfo,
        wave: Result<Waveform, DecodeError>,
    },
}

/// Read `file` (`len` bytes when it was opened) once, in pieces of [`STREAM_PIECE`] bytes, with
/// memory bounded whatever its size: the header is parsed first (reading only what the parser
/// looks at: a file that is not a WAV is not read further), then the whole file is hashed as
/// its pieces pass, and only the frames that reach the first `num_samples` samples at
/// `sample_rate` are decoded, as they pass. Gives what [`decode`] and blake3 of the whole file
/// give. Reads at most `len + 1` bytes (the one more tells the caller that the file grew).
pub fn stream_file(
    file: &std::fs::File,
    len: u64,
    sample_rate: u32,
    num_samples: usize,
) -> std::io::Result<Streamed> {
    let info = match parse_file_header(file, len)? {
        Ok(info) => info,
        Err(e) => return Ok(Streamed::BadHeader(e)),
    };
    let mut sink = Sink::new(&info, sample_rate, num_samples);
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; STREAM_PIECE];
    let limit = len.saturating_add(1);
    let mut pos = 0u64;
    while pos < limit {
        let want = (limit - pos).min(buf.len() as u64) as usize;
        let n = match std::os::unix::fs::FileExt::read_at(file, &mut buf[..want], pos) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        if let Ok(s) = &mut sink {
            s.feed(pos, &buf[..n]);
        }
        let next = pos + n as u64;
        if next / DROP_EVERY != pos / DROP_EVERY {
            drop_cached(file, next);
        }
        pos = next;
    }
    Ok(Streamed::Read {
        len: pos,
        hash: *hasher.finalize().as_bytes(),
        wave: sink.and_then(Sink::finish),
        info,
    })
}

/// [`stream_file`] lets the page cache go of what it has read every this many bytes.
const DROP_EVERY: u64 = 8 << 20;

/// Let the kernel drop the cached pages of `file` below `end` (`POSIX_FADV_DONTNEED`; pages
/// still to be written back are only queued for it): a large file read once does not fill the
/// page cache, nor push out what other programs use.
fn drop_cached(file: &std::fs::File, end: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on an open descriptor; only advice.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            0,
            end as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

/// The decoding side of [`stream_file`]: takes the bytes of the data chunk that the row needs as
/// they pass, and turns whole frames into samples at once (a frame cut by a piece's end waits
/// for the rest of it).
struct Sink {
    /// The file offsets of the bytes needed.
    from: u64,
    to: u64,
    block: usize,
    /// The start of a frame cut by the end of a piece.
    carry: Vec<u8>,
    out: SinkOut,
    num_samples: usize,
    info: WavInfo,
}

enum SinkOut {
    /// 16-bit mono at the rate: the samples as they are.
    Pcm16(Vec<i16>),
    /// Mono float at the file's rate, to be resampled if `resampler` is set.
    Mono {
        mono: Vec<f32>,
        resampler: Option<Box<BandLimited>>,
    },
}

impl Sink {
    /// As [`decode_parsed`] chooses: how many frames, and what becomes of them.
    fn new(info: &WavInfo, sample_rate: u32, num_samples: usize) -> Result<Sink, DecodeError> {
        let (frames, out) = if info.is_waveform_at(sample_rate) {
            let n = num_samples.min(info.frames);
            (n, SinkOut::Pcm16(buffers::take(num_samples)))
        } else if info.sample_rate == sample_rate {
            let n = num_samples.min(info.frames);
            (
                n,
                SinkOut::Mono {
                    mono: Vec::with_capacity(n),
                    resampler: None,
                },
            )
        } else {
            let resampler = BandLimited::new(info.sample_rate, sample_rate)?;
            let n = resampler.input_needed(num_samples).min(info.frames);
            (
                n,
                SinkOut::Mono {
                    mono: Vec::with_capacity(n),
                    resampler: Some(Box::new(resampler)),
                },
            )
        };
        let block = usize::from(info.block_align);
        let from = info.data_offset as u64;
        Ok(Sink {
            from,
            to: from + (frames * block) as u64,
            block,
            carry: Vec::with_capacity(block),
            out,
            num_samples,
            info: info.clone(),
        })
    }

    /// The piece of the file at `pos`.
    fn feed(&mut self, pos: u64, piece: &[u8]) {
        let end = pos + piece.len() as u64;
        if end <= self.from || pos >= self.to {
            return;
        }
        let a = (self.from.max(pos) - pos) as usize;
        let b = (self.to.min(end) - pos) as usize;
        let mut bytes = &piece[a..b];
        if !self.carry.is_empty() {
            let k = (self.block - self.carry.len()).min(bytes.len());
            self.carry.extend_from_slice(&bytes[..k]);
            bytes = &bytes[k..];
            if self.carry.len() < self.block {
                return;
            }
            let frame = std::mem::take(&mut self.carry);
            self.frames(&frame);
            self.carry = frame;
            self.carry.clear();
        }
        let whole = bytes.len() / self.block * self.block;
        self.frames(&bytes[..whole]);
        self.carry.extend_from_slice(&bytes[whole..]);
    }

    fn frames(&mut self, data: &[u8]) {
        match &mut self.out {
            SinkOut::Pcm16(v) => v.extend(
                data.chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]])),
            ),
            SinkOut::Mono { mono, .. } => mono_into(data, &self.info, mono),
        }
    }

    /// The row's samples, once every needed byte has passed (fewer if the file was cut short:
    /// the caller notices its change of size).
    fn finish(self) -> Result<Waveform, DecodeError> {
        let n = self.num_samples;
        match self.out {
            SinkOut::Pcm16(mut v) => {
                v.resize(n, 0);
                Ok(Waveform::Pcm16(v))
            }
            SinkOut::Mono {
                mut mono,
                resampler,
            } => {
                check_finite(&mono)?;
                if let Some(mut r) = resampler {
                    mono = r.run(&mono, self.info.frames, n)?;
                }
                mono.resize(n, 0.0);
                Ok(Waveform::Float(mono))
            }
        }
    }
}

/// Sample-rate conversion with rubato's FFT resampler: a synchronous (exact rational ratio)
/// resampler whose anti-aliasing filter is a windowed sinc as long as one FFT block, with a delay
/// of exactly half an output block, which [`BandLimited::run`] removes.
struct BandLimited {
    from: u32,
    to: u32,
    inner: rubato::FftFixedInOut<f32>,
}

/// Least output-rate length of the anti-aliasing filter. Measured from 8192 to 4096 Hz: flat
/// (< 0.01 dB) up to 2000 Hz, and what lies above 2048 Hz more than 115 dB down, below 16-bit
/// quantisation.
const FILTER_LEN_OUT: u64 = 1024;

impl BandLimited {
    fn new(from: u32, to: u32) -> Result<Self, DecodeError> {
        let err = |reason: String| DecodeError::Resample { from, to, reason };
        if to == 0 {
            return Err(err("the target sample rate is 0 Hz".into()));
        }
        let g = gcd(u64::from(from), u64::from(to));
        let (p, q) = (u64::from(to) / g, u64::from(from) / g);
        // A block is `blocks` times (q in, p out) frames. The filter is centred on the middle of
        // the input block and rubato removes half an output block: both halves must be whole
        // frames for the two to coincide, and since p and q are coprime that takes an even
        // number of blocks.
        let blocks = FILTER_LEN_OUT.div_ceil(p).next_multiple_of(2);
        let inner =
            rubato::FftFixedInOut::new(from as usize, to as usize, (blocks * q) as usize, 1)
                .map_err(|e| err(e.to_string()))?;
        Ok(BandLimited { from, to, inner })
    }

    /// Input frames that influence the first `num_samples` output samples.
    fn input_needed(&self, num_samples: usize) -> usize {
        let exact = (num_samples as u128 * u128::from(self.from)).div_ceil(u128::from(self.to));
        // One input block covers the filter's reach past the last output sample.
        usize::try_from(exact)
            .unwrap_or(usize::MAX)
            .saturating_add(self.inner.input_frames_next())
    }

    /// Resample `input` (the first frames of a recording `total_frames` long) and return at most
    /// `num_samples` samples, time-aligned with the input.
    fn run(
        &mut self,
        input: &[f32],
        total_frames: usize,
        num_samples: usize,
    ) -> Result<Vec<f32>, DecodeError> {
        let full_len = (total_frames as u128 * u128::from(self.to)).div_ceil(u128::from(self.from));
        let want = usize::try_from(full_len)
            .unwrap_or(usize::MAX)
            .min(num_samples);
        let chunk_in = self.inner.input_frames_next();
        let chunk_out = self.inner.output_frames_next();
        let delay = self.inner.output_delay();
        let mut out = Vec::with_capacity(delay + want + chunk_out);
        let mut block_in = vec![0f32; chunk_in];
        let mut block_out = vec![0f32; chunk_out];
        let mut pos = 0;
        // Past the end of the input, zeros flush the filter's tail into the last samples.
        while out.len() < delay + want {
            let n = chunk_in.min(input.len() - pos);
            block_in[..n].copy_from_slice(&input[pos..pos + n]);
            block_in[n..].fill(0.0);
            pos += n;
            self.inner
                .process_into_buffer(&[&block_in[..]], &mut [&mut block_out[..]], None)
                .map_err(|e| DecodeError::Resample {
                    from: self.from,
                    to: self.to,
                    reason: e.to_string(),
                })?;
            out.extend_from_slice(&block_out);
        }
        out.drain(..delay);
        out.truncate(want);
        Ok(out)
    }
}

/// Greatest common divisor (also used for the staging HDF5 files' alignment).
pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-byte fmt chunk body.
    fn fmt(tag: u16, channels: u16, rate: u32, bits: u16) -> Vec<u8> {
        let align = channels * (bits / 8);
        let mut f = Vec::new();
        f.extend(tag.to_le_bytes());
        f.extend(channels.to_le_bytes());
        f.extend(rate.to_le_bytes());
        f.extend((rate * u32::from(align)).to_le_bytes());
        f.extend(align.to_le_bytes());
        f.extend(bits.to_le_bytes());
        f
    }

    /// A 40-byte WAVE_FORMAT_EXTENSIBLE fmt chunk body for sub-format `tag`.
    fn fmt_extensible(tag: u16, channels: u16, rate: u32, bits: u16) -> Vec<u8> {
        let mut f = fmt(WAVE_FORMAT_EXTENSIBLE, channels, rate, bits);
        f.extend(22u16.to_le_bytes()); // cbSize
        f.extend(bits.to_le_bytes()); // valid bits
        f.extend(0u32.to_le_bytes()); // channel mask
        f.extend(tag.to_le_bytes());
        f.extend(SUBFORMAT_GUID_TAIL);
        f
    }

    /// A RIFF/WAVE file of the given chunks, each padded to an even size, RIFF size exact.
    fn riff(chunks: &[(&[u8; 4], &[u8])]) -> Vec<u8> {
        let mut b = b"RIFF\0\0\0\0WAVE".to_vec();
        for (id, body) in chunks {
            b.extend(*id);
            b.extend((body.len() as u32).to_le_bytes());
            b.extend(*body);
            if body.len() % 2 == 1 {
                b.push(0);
            }
        }
        let riff_size = (b.len() - 8) as u32;
        b[4..8].copy_from_slice(&riff_size.to_le_bytes());
        b
    }

    fn wav(tag: u16, channels: u16, rate: u32, bits: u16, data: &[u8]) -> Vec<u8> {
        riff(&[(b"fmt ", &fmt(tag, channels, rate, bits)), (b"data", data)])
    }

    fn pcm16(samples: &[i16]) -> Vec<u8> {
        samples.iter().flat_map(|s| s.to_le_bytes()).collect()
    }

    fn floats(w: Waveform) -> Vec<f32> {
        match w {
            Waveform::Float(v) => v,
            Waveform::Pcm16(_) => panic!("expected a float waveform"),
        }
    }

    /// Reading a file in pieces ([`stream_file`]) gives what reading it whole gives: blake3 of
    /// the bytes, [`parse_header`] and [`decode`], whatever the format (frames cut by the end of
    /// a piece: 3- and 6-byte frames, odd offsets), the rate (resampled or not), and the length
    /// (shorter than a row, several pieces longer); a bad header stops the reading.
    #[test]
    fn streaming_a_file_gives_what_reading_it_whole_gives() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.wav");
        let long = STREAM_PIECE * 2 + 1234;
        let bytes = |n: usize, seed: u32| -> Vec<u8> {
            (0..n as u32)
                .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
                .collect()
        };
        let floats: Vec<u8> = (0..long / 4)
            .flat_map(|i| ((i as f32 * 0.001).sin() * 0.5).to_le_bytes())
            .collect();
        let mut nan = floats.clone();
        nan[STREAM_PIECE + 4..STREAM_PIECE + 8].copy_from_slice(&f32::NAN.to_le_bytes());
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("pcm16 mono", wav(1, 1, 4096, 16, &bytes(long & !1, 1))),
            ("pcm16 mono short", wav(1, 1, 4096, 16, &bytes(3000, 2))),
            (
                "pcm16 mono, odd chunk before data",
                riff(&[
                    (b"fmt ", &fmt(1, 1, 4096, 16)),
                    (b"LIST", b"abc"),
                    (b"data", &bytes(long & !1, 3)),
                ]),
            ),
            ("pcm24 mono", wav(1, 1, 4096, 24, &bytes(long / 3 * 3, 4))),
            ("pcm24 stereo", wav(1, 2, 4096, 24, &bytes(long / 6 * 6, 5))),
            (
                "pcm16 stereo 8192 Hz",
                wav(1, 2, 8192, 16, &bytes(long / 4 * 4, 6)),
            ),
            ("pcm8 44100 Hz", wav(1, 1, 44_100, 8, &bytes(long, 7))),
            ("float 4096 Hz", wav(3, 1, 4096, 32, &floats)),
            ("float with a NaN", wav(3, 1, 4096, 32, &nan)),
            ("not a wav", bytes(long, 8)),
            ("zeros", vec![0; long]),
        ];
        for (name, file) in cases {
            std::fs::write(&path, &file).unwrap();
            for num_samples in [100, 40_960, 200_000] {
                let f = std::fs::File::open(&path).unwrap();
                let got = stream_file(&f, file.len() as u64, 4096, num_samples).unwrap();
                match (got, parse_header(&file)) {
                    (Streamed::BadHeader(e), Err(want)) => assert_eq!(e, want, "{name}"),
                    (
                        Streamed::Read {
                            len,
                            hash,
                            info,
                            wave,
                        },
                        Ok(want),
                    ) => {
                        assert_eq!(len, file.len() as u64, "{name}");
                        assert_eq!(hash, *blake3::hash(&file).as_bytes(), "{name}");
                        assert_eq!(info, want, "{name}");
                        assert_eq!(
                            wave,
                            decode(&file, 4096, num_samples),
                            "{name}, {num_samples} samples"
                        );
                    }
                    (got, want) => panic!("{name}: {got:?} against {want:?}"),
                }
            }
            // The header, read in parts, says what the whole file says.
            let f = std::fs::File::open(&path).unwrap();
            assert_eq!(
                parse_file_header(&f, file.len() as u64).unwrap(),
                parse_header(&file),
                "{name}"
            );
        }
        // A file that grew since its length was taken: one byte more is read, and no more.
        let file = wav(1, 1, 4096, 16, &bytes(long & !1, 9));
        let mut grown = file.clone();
        grown.extend(b"LIST\x04\x00\x00\x00abcd");
        std::fs::write(&path, &grown).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        match stream_file(&f, file.len() as u64, 4096, 100).unwrap() {
            Streamed::Read { len, .. } => assert_eq!(len, file.len() as u64 + 1),
            other => panic!("{other:?}"),
        }
    }

    /// Decoding a file read into a pooled buffer (in place for 16-bit mono) gives what decoding
    /// its bytes gives, whatever the format, length and parity of the file.
    #[test]
    fn file_bytes_decode_like_the_bytes() {
        let samples: Vec<i16> = (0..300).map(|i| (i * 217 - 30_000) as i16).collect();
        let odd_chunk = riff(&[
            (b"fmt ", &fmt(1, 1, 4096, 16)),
            (b"LIST", b"abc"),
            (b"data", &pcm16(&samples)),
        ]);
        let mut trailing = wav(1, 1, 4096, 16, &pcm16(&samples));
        trailing.push(7);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("pcm16 mono", wav(1, 1, 4096, 16, &pcm16(&samples))),
            ("pcm16 mono, odd chunk before data", odd_chunk),
            ("pcm16 mono, odd trailing byte", trailing),
            ("pcm16 stereo", wav(1, 2, 4096, 16, &pcm16(&samples))),
            ("pcm16 other rate", wav(1, 1, 8192, 16, &pcm16(&samples))),
            ("float", wav(3, 1, 4096, 32, &pcm16(&samples))),
            ("not a wav", b"hello, world".to_vec()),
            ("empty", Vec::new()),
        ];
        let dir = tempfile::tempdir().unwrap();
        for (name, file) in cases {
            let path = dir.path().join("x.wav");
            std::fs::write(&path, &file).unwrap();
            for num_samples in [100, 300, 400] {
                let f = std::fs::File::open(&path).unwrap();
                let read = FileBytes::read(&f, file.len() as u64 + 1).unwrap();
                assert_eq!(read.bytes(), &file[..], "{name}");
                assert_eq!(
                    read.decode(4096, num_samples),
                    decode(&file, 4096, num_samples),
                    "{name}, {num_samples} samples"
                );
            }
        }
    }

    fn err(bytes: &[u8]) -> DecodeError {
        decode(bytes, 4096, 16).expect_err("should be rejected")
    }

    #[test]
    fn pcm16_mono_at_rate_is_copied_and_padded_or_trimmed() {
        let s = [0i16, 1, -1, i16::MAX, i16::MIN, 1234];
        let w = wav(1, 1, 4096, 16, &pcm16(&s));
        assert_eq!(
            decode(&w, 4096, 8).unwrap(),
            Waveform::Pcm16(vec![0, 1, -1, i16::MAX, i16::MIN, 1234, 0, 0])
        );
        assert_eq!(
            decode(&w, 4096, 3).unwrap(),
            Waveform::Pcm16(vec![0, 1, -1])
        );
        let info = parse_header(&w).unwrap();
        assert_eq!(info.format, SampleFormat::Pcm16);
        assert_eq!(
            (info.channels, info.sample_rate, info.bits_per_sample),
            (1, 4096, 16)
        );
        assert_eq!(
            (
                info.block_align,
                info.data_offset,
                info.data_len,
                info.frames
            ),
            (2, 44, 12, 6)
        );
    }

    #[test]
    fn u8_is_centred_on_128() {
        let w = wav(1, 1, 4096, 8, &[0, 64, 128, 255]);
        assert_eq!(
            floats(decode(&w, 4096, 5).unwrap()),
            [-1.0, -0.5, 0.0, 127.0 / 128.0, 0.0]
        );
    }

    #[test]
    fn pcm24_is_packed_little_endian_and_sign_extended() {
        let vals = [-8_388_608i32, 8_388_607, 1, -1, 0x12_3456];
        let data: Vec<u8> = vals
            .iter()
            .flat_map(|v| v.to_le_bytes()[..3].to_vec())
            .collect();
        let got = floats(decode(&wav(1, 1, 4096, 24, &data), 4096, 5).unwrap());
        let want: Vec<f32> = vals
            .iter()
            .map(|&v| (f64::from(v) / 8_388_608.0) as f32)
            .collect();
        assert_eq!(got, want);
        assert_eq!(got[0], -1.0);
    }

    #[test]
    fn pcm32_is_divided_by_2_pow_31() {
        let vals = [i32::MIN, i32::MAX, 1 << 16, -(1 << 30)];
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = floats(decode(&wav(1, 1, 4096, 32, &data), 4096, 4).unwrap());
        assert_eq!(
            got,
            [
                -1.0,
                (f64::from(i32::MAX) / 2_147_483_648.0) as f32,
                1.0 / 32768.0,
                -0.5
            ]
        );
    }

    #[test]
    fn float_is_taken_as_is() {
        let vals = [0.25f32, -0.75, 1e-7, 0.999];
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(
            floats(decode(&wav(3, 1, 4096, 32, &data), 4096, 4).unwrap()),
            vals
        );
        let data64: Vec<u8> = vals
            .iter()
            .flat_map(|v| f64::from(*v).to_le_bytes())
            .collect();
        assert_eq!(
            floats(decode(&wav(3, 1, 4096, 64, &data64), 4096, 4).unwrap()),
            vals
        );
    }

    #[test]
    fn non_finite_float_is_rejected() {
        let data: Vec<u8> = [0.5f32, f32::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            err(&wav(3, 1, 4096, 32, &data)),
            DecodeError::NonFinite { frame: 1 }
        );
    }

    #[test]
    fn channels_are_averaged() {
        // Frames (1000, -3000) and (32767, 32767).
        let w = wav(1, 2, 4096, 16, &pcm16(&[1000, -3000, 32767, 32767]));
        let got = floats(decode(&w, 4096, 2).unwrap());
        assert_eq!(got, [-1000.0 / 32768.0, 32767.0 / 32768.0]);
        let three = wav(1, 3, 4096, 8, &[128, 129, 130]);
        assert_eq!(
            floats(decode(&three, 4096, 1).unwrap()),
            [(3.0f64 / 3.0 / 128.0) as f32]
        );
    }

    #[test]
    fn extensible_uses_the_subformat() {
        let data = pcm16(&[100, 300, -100, -300]);
        let w = riff(&[(b"fmt ", &fmt_extensible(1, 2, 4096, 16)), (b"data", &data)]);
        assert_eq!(
            floats(decode(&w, 4096, 2).unwrap()),
            [200.0 / 32768.0, -200.0 / 32768.0]
        );
        // Mono 16-bit extensible is the plain fast path.
        let mono = riff(&[(b"fmt ", &fmt_extensible(1, 1, 4096, 16)), (b"data", &data)]);
        assert_eq!(
            decode(&mono, 4096, 4).unwrap(),
            Waveform::Pcm16(vec![100, 300, -100, -300])
        );
        let fl = riff(&[
            (b"fmt ", &fmt_extensible(3, 1, 4096, 32)),
            (b"data", &0.5f32.to_le_bytes()),
        ]);
        assert_eq!(floats(decode(&fl, 4096, 1).unwrap()), [0.5]);
        let alaw = riff(&[
            (b"fmt ", &fmt_extensible(6, 1, 4096, 8)),
            (b"data", &[0; 4]),
        ]);
        assert!(err(&alaw).to_string().contains("A-law"));
        let mut odd = fmt_extensible(1, 1, 4096, 16);
        odd[39] ^= 0xFF;
        let odd = riff(&[(b"fmt ", &odd), (b"data", &data)]);
        assert!(matches!(err(&odd), DecodeError::UnknownSubformat(_)));
        let short = riff(&[
            (b"fmt ", &fmt_extensible(1, 1, 4096, 16)[..24]),
            (b"data", &data),
        ]);
        assert_eq!(
            err(&short),
            DecodeError::FmtTooShort {
                size: 24,
                needed: 40
            }
        );
    }

    #[test]
    fn chunks_before_data_are_skipped_with_their_pad_byte() {
        let data = pcm16(&[7, -7]);
        let w = riff(&[
            (b"fmt ", &fmt(1, 1, 4096, 16)),
            (b"fact", &2u32.to_le_bytes()),
            (b"junk", b"odd"), // 3 bytes + 1 pad byte
            (b"LIST", b"INFOISFT\x05\0\0\0abcde"),
            (b"data", &data),
            (b"LIST", b"after the data is fine"),
        ]);
        assert_eq!(decode(&w, 4096, 2).unwrap(), Waveform::Pcm16(vec![7, -7]));
        assert_eq!(parse_header(&w).unwrap().data_offset, w.len() - 8 - 22 - 4);
    }

    #[test]
    fn odd_data_chunk_without_pad_byte_is_accepted() {
        let mut w = wav(1, 1, 4096, 8, &[128, 255, 0]);
        w.pop(); // the pad byte
        assert_eq!(
            floats(decode(&w, 4096, 3).unwrap()),
            [0.0, 127.0 / 128.0, -1.0]
        );
    }

    #[test]
    fn messages_name_the_problem() {
        let good = wav(1, 1, 4096, 16, &pcm16(&[1; 64]));
        let cases: Vec<(Vec<u8>, DecodeError, &str)> = vec![
            (vec![], DecodeError::Empty, "empty file (0 bytes)"),
            (
                b"hello, not audio".to_vec(),
                DecodeError::NotWav,
                "not a WAV file",
            ),
            (
                [b"RIFX".as_slice(), &good[4..]].concat(),
                DecodeError::UnsupportedContainer("big-endian RIFX"),
                "RIFX",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 0, 4096, 16)), (b"data", &[0; 4])]),
                DecodeError::ZeroChannels,
                "fmt declares 0 channels",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 65, 4096, 16)), (b"data", &[0; 130])]),
                DecodeError::TooManyChannels(65),
                "65 channels",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 1, 0, 16)), (b"data", &[0; 4])]),
                DecodeError::ZeroSampleRate,
                "sample rate of 0 Hz",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 1, 10_000_000, 16)), (b"data", &[0; 4])]),
                DecodeError::SampleRateOutOfRange(10_000_000),
                "10000000 Hz",
            ),
            (
                riff(&[(b"fmt ", &fmt(6, 1, 4096, 8)), (b"data", &[0; 4])]),
                DecodeError::UnsupportedEncoding { tag: 6, bits: 8 },
                "unsupported encoding: A-law (format tag 6); only PCM 8/16/24/32-bit",
            ),
            (
                riff(&[(b"fmt ", &fmt(7, 1, 4096, 8)), (b"data", &[0; 4])]),
                DecodeError::UnsupportedEncoding { tag: 7, bits: 8 },
                "mu-law",
            ),
            (
                riff(&[(b"fmt ", &fmt(2, 1, 4096, 4)), (b"data", &[0; 4])]),
                DecodeError::UnsupportedEncoding { tag: 2, bits: 4 },
                "ADPCM",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 1, 4096, 12)), (b"data", &[0; 4])]),
                DecodeError::UnsupportedEncoding { tag: 1, bits: 12 },
                "12-bit PCM",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 1, 4096, 16)[..14]), (b"data", &[0; 4])]),
                DecodeError::FmtTooShort {
                    size: 14,
                    needed: 16,
                },
                "fmt chunk is 14 bytes",
            ),
            (
                riff(&[(b"data", &[0; 4]), (b"fmt ", &fmt(1, 1, 4096, 16))]),
                DecodeError::NoFmt,
                "no fmt chunk",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 1, 4096, 16))]),
                DecodeError::NoData,
                "no data chunk",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 1, 4096, 16)), (b"data", &[])]),
                DecodeError::NoFrames,
                "no audio frames",
            ),
            (
                riff(&[(b"fmt ", &fmt(1, 2, 4096, 16)), (b"data", &[0; 6])]),
                DecodeError::PartialFrame {
                    data_len: 6,
                    block_align: 4,
                },
                "not a whole number of 4-byte frames",
            ),
        ];
        for (bytes, want, words) in cases {
            let got = err(&bytes);
            assert_eq!(got, want);
            assert!(got.to_string().contains(words), "{got} lacks {words:?}");
            assert!(!got.is_incomplete(), "{got}");
        }
        let mut bad_align = wav(1, 2, 4096, 16, &[0; 8]);
        bad_align[32] = 3;
        assert_eq!(
            err(&bad_align).to_string(),
            "fmt declares block_align 3, but 2 channels of 16 bits need 4"
        );
    }

    #[test]
    fn sizes_beyond_the_file() {
        let good = wav(1, 1, 4096, 16, &pcm16(&[1; 64]));
        // Cut inside the data chunk: truncated, and it may still be arriving.
        let e = err(&good[..100]);
        assert_eq!(
            e.to_string(),
            "truncated: data chunk declares 128 bytes but only 56 are present"
        );
        assert!(e.is_incomplete());
        // Cut inside a chunk header, or inside the RIFF header itself.
        assert_eq!(
            err(b"RIF"),
            DecodeError::TruncatedChunkHeader { file_len: 3 }
        );
        assert_eq!(
            err(&good[..40]),
            DecodeError::TruncatedChunkHeader { file_len: 40 }
        );
        // Cut right after fmt: the RIFF says more is coming.
        assert!(
            matches!(err(&good[..36]), DecodeError::Truncated { chunk: ChunkId(c), .. } if &c == b"RIFF")
        );
        // A chunk that claims more than even the RIFF size: a corrupt header, not truncation.
        let mut huge = good.clone();
        huge[16..20].copy_from_slice(&0x8000_0000u32.to_le_bytes());
        let e = err(&huge);
        assert_eq!(
            e.to_string(),
            format!(
                "chunk `fmt` claims 2147483648 bytes, more than the file ({} bytes)",
                good.len()
            )
        );
        assert!(!e.is_incomplete());
        let mut huge_data = good.clone();
        huge_data[40..44].copy_from_slice(&0x7FFF_0000u32.to_le_bytes());
        assert!(matches!(err(&huge_data), DecodeError::ChunkTooLarge { .. }));
        // Data complete, but the RIFF promised a trailing chunk that is not there (yet).
        let mut riff_long = good.clone();
        riff_long[4..8].copy_from_slice(&(good.len() as u32 + 100).to_le_bytes());
        let e = err(&riff_long);
        assert!(e.is_incomplete());
        assert!(
            e.to_string().starts_with("truncated: RIFF chunk declares"),
            "{e}"
        );
    }

    #[test]
    fn recorder_placeholders_are_in_progress() {
        let good = wav(1, 1, 4096, 16, &pcm16(&[1; 64]));
        for (at, v) in [(4, 0u32), (4, u32::MAX), (40, u32::MAX), (40, 0)] {
            let mut b = good.clone();
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
            let e = err(&b);
            assert_eq!(e, DecodeError::PlaceholderSizes, "size {v:#x} at {at}");
            assert!(e.to_string().starts_with("recording in progress"));
            assert!(e.is_incomplete());
        }
        // A header rewritten now and then lags the audio behind it.
        let mut stale = good.clone();
        stale[40..44].copy_from_slice(&64u32.to_le_bytes());
        stale[4..8].copy_from_slice(&(36u32 + 64).to_le_bytes());
        let e = err(&stale);
        assert_eq!(
            e,
            DecodeError::StaleHeader {
                declared: 64,
                present: 128
            }
        );
        assert!(e.is_incomplete());
        // ...but a chunk appended after the RIFF by some tagger is not audio.
        let mut tagged = good.clone();
        tagged.extend(b"id3 \x04\0\0\0TAG!");
        assert!(decode(&tagged, 4096, 64).is_ok());
        // ...nor an ID3 tag appended outside any chunk, as taggers of MP3 files write them: an
        // ID3v2 tag (here 20 bytes of frames and a 100-byte ID3v1 tag after it), or an ID3v1
        // tag alone (the last 128 bytes).
        let mut id3v2 = good.clone();
        id3v2.extend(b"ID3\x03\0\0\0\0\0\x14");
        id3v2.extend([b'T'; 20]);
        let mut both = id3v2.clone();
        both.extend(b"TAG");
        both.extend([b' '; 125]);
        let mut id3v1 = good.clone();
        id3v1.extend(b"TAG");
        id3v1.extend([b' '; 125]);
        for (name, b) in [
            ("ID3v2", &id3v2),
            ("ID3v2 and ID3v1", &both),
            ("ID3v1", &id3v1),
        ] {
            assert!(
                decode(b, 4096, 64).is_ok(),
                "{name}: {:?}",
                decode(b, 4096, 64).err()
            );
        }
        // A tag whose size the file cannot hold, or "TAG" not 128 bytes from the end, may be
        // audio that happens to begin with those bytes: still in progress.
        let mut short_v2 = good.clone();
        short_v2.extend(b"ID3\x03\0\0\0\0\x01\0");
        short_v2.extend([b'T'; 20]);
        let mut short_v1 = good.clone();
        short_v1.extend(b"TAG");
        short_v1.extend([b' '; 124]);
        for (name, b) in [
            ("ID3v2 too long", &short_v2),
            ("TAG of 127 bytes", &short_v1),
        ] {
            let e = decode(b, 4096, 64).err().unwrap().to_string();
            assert!(e.starts_with("recording in progress"), "{name}: {e}");
        }
    }

    /// `n` samples of a sine with amplitude `a` at `f` Hz sampled at `rate`, as f64.
    fn sine(a: f64, f: f64, rate: f64, n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| a * (std::f64::consts::TAU * f * i as f64 / rate).sin())
            .collect()
    }

    fn to_pcm16(x: &[f64]) -> Vec<u8> {
        x.iter()
            .flat_map(|v| ((v * 32768.0).round() as i16).to_le_bytes())
            .collect()
    }

    /// Amplitude of the component at `f` Hz (a single DFT bin, Hann-windowed against leakage).
    fn amplitude_at(x: &[f32], f: f64, rate: f64) -> f64 {
        let n = x.len() as f64;
        let (mut re, mut im, mut wsum) = (0.0, 0.0, 0.0);
        for (i, &v) in x.iter().enumerate() {
            let w = 0.5 - 0.5 * (std::f64::consts::TAU * i as f64 / n).cos();
            let ph = std::f64::consts::TAU * f * i as f64 / rate;
            re += w * f64::from(v) * ph.cos();
            im -= w * f64::from(v) * ph.sin();
            wsum += w;
        }
        2.0 * (re * re + im * im).sqrt() / wsum
    }

    fn correlation(a: &[f32], b: &[f64]) -> f64 {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * y).sum();
        let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
        let nb: f64 = b.iter().map(|y| y * y).sum();
        dot / (na * nb).sqrt()
    }

    #[test]
    fn resampling_keeps_amplitude_and_time_alignment() {
        // 1 s of 440 Hz at each rate against the same tone generated at 4096 Hz.
        let reference = sine(0.5, 440.0, 4096.0, 4096);
        for from in [8192u32, 2048, 8000, 44_100, 48_000] {
            let x = sine(0.5, 440.0, f64::from(from), from as usize);
            let got = floats(decode(&wav(1, 1, from, 16, &to_pcm16(&x)), 4096, 4096).unwrap());
            assert_eq!(got.len(), 4096);
            let c = correlation(&got, &reference);
            assert!(c > 0.99, "{from} Hz: correlation {c}");
            // Away from the edges (where the recording starts and stops abruptly) the samples
            // match the reference closely: no delay, no gain error.
            let worst = got[256..3840]
                .iter()
                .zip(&reference[256..3840])
                .map(|(g, r)| (f64::from(*g) - r).abs())
                .fold(0.0, f64::max);
            assert!(worst < 2e-3, "{from} Hz: max error {worst}");
            let amp = amplitude_at(&got, 440.0, 4096.0);
            assert!((amp - 0.5).abs() < 0.005, "{from} Hz: amplitude {amp}");
        }
    }

    #[test]
    fn resampled_length_is_the_recording_length_then_zero_padding() {
        // 0.5 s at 8192 Hz is 2048 samples at 4096 Hz; the rest is padding.
        let x = sine(0.5, 440.0, 8192.0, 4096);
        let got = floats(decode(&wav(1, 1, 8192, 16, &to_pcm16(&x)), 4096, 4096).unwrap());
        assert!(got[2000..2048].iter().any(|v| v.abs() > 0.1));
        assert!(got[2048..].iter().all(|v| *v == 0.0));
        // Trimming a long recording gives the same samples as decoding it whole.
        let long = sine(0.5, 440.0, 8192.0, 81920);
        let long = wav(1, 1, 8192, 16, &to_pcm16(&long));
        let whole = floats(decode(&long, 4096, 40960).unwrap());
        let first = floats(decode(&long, 4096, 1000).unwrap());
        for (a, b) in first.iter().zip(&whole) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn downsampling_removes_what_would_alias() {
        // As the tone_8192hz fixture: 451 Hz plus 3 kHz, above the new Nyquist (2048 Hz); without
        // an anti-aliasing filter the 3 kHz would fold to 4096 - 3000 = 1096 Hz.
        let a = sine(0.35, 451.2, 8192.0, 81920);
        let b = sine(0.2, 3000.0, 8192.0, 81920);
        let x: Vec<f64> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
        let got = floats(decode(&wav(1, 1, 8192, 16, &to_pcm16(&x)), 4096, 40960).unwrap());
        let main = amplitude_at(&got, 451.2, 4096.0);
        let alias = amplitude_at(&got, 1096.0, 4096.0);
        assert!((main - 0.35).abs() < 0.005, "main {main}");
        let db = 20.0 * (alias / main).log10();
        assert!(db < -60.0, "alias only {db} dB below the main component");
    }

    #[test]
    fn bad_target_rate_is_an_error() {
        let w = wav(1, 1, 4096, 16, &pcm16(&[1; 8]));
        assert!(matches!(
            decode(&w, 0, 8),
            Err(DecodeError::Resample { .. })
        ));
    }

    /// Every prefix, every single-byte change and random files: an error or a waveform of the
    /// requested length, never a panic.
    #[test]
    fn malformed_inputs_never_panic() {
        let check = |b: &[u8]| match decode(b, 4096, 64) {
            Ok(w) => assert_eq!(w.len(), 64),
            Err(e) => assert!(!e.to_string().is_empty()),
        };
        let bases = [
            wav(1, 1, 4096, 16, &pcm16(&[3; 40])),
            wav(1, 2, 8000, 24, &[9; 66]),
            riff(&[
                (b"fmt ", &fmt_extensible(3, 1, 4096, 32)),
                (b"LIST", b"abc"),
                (b"data", &0.5f32.to_le_bytes().repeat(8)),
            ]),
        ];
        for base in &bases {
            for n in 0..=base.len() {
                check(&base[..n]);
            }
            for i in 0..base.len() {
                for v in [0u8, 1, 0x7F, 0x80, 0xFF, base[i] ^ 1] {
                    let mut m = base.clone();
                    m[i] = v;
                    check(&m);
                }
            }
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let n = (next() % 96) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            // Give most of them a plausible start so the parser gets past the magic.
            if n >= 12 && next() % 4 != 0 {
                b[..4].copy_from_slice(b"RIFF");
                b[8..12].copy_from_slice(b"WAVE");
                if n >= 20 && next() % 2 == 0 {
                    b[12..16].copy_from_slice(b"fmt ");
                    b[16..20].copy_from_slice(&((next() % 48) as u32).to_le_bytes());
                }
            }
            check(&b);
        }
    }
}
