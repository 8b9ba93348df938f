//! IDX files (the MNIST format), plain or gzipped, and the Fashion-MNIST data set made of them.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Where Debian's `dataset-fashion-mnist` package installs the files.
pub const DEFAULT_DATA_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// IDX type code of unsigned bytes, the only one MNIST-style files use.
const UBYTE: u8 = 0x08;

/// The gzip magic number.
const GZIP: [u8; 2] = [0x1f, 0x8b];

/// An IDX file of unsigned bytes: its dimensions and its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idx {
    /// Size of each dimension, outermost first.
    pub dims: Vec<usize>,
    /// The values, row-major.
    pub data: Vec<u8>,
}

/// Parses IDX bytes (already decompressed) with `ndim` dimensions.
///
/// Fails naming `what` if the magic number, the type, the number of
/// dimensions or the length disagree with the header.
pub fn parse(bytes: &[u8], ndim: usize, what: &str) -> Result<Idx, String> {
    let bad = |why: String| format!("{what}: not a valid IDX file: {why}");
    if bytes.len() < 4 {
        return Err(bad(format!(
            "{} bytes, shorter than the header",
            bytes.len()
        )));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad(format!(
            "magic number starts {:02x} {:02x}, expected 00 00",
            bytes[0], bytes[1]
        )));
    }
    if bytes[2] != UBYTE {
        return Err(bad(format!(
            "element type 0x{:02x}, expected 0x08 (unsigned byte)",
            bytes[2]
        )));
    }
    if bytes[3] as usize != ndim {
        return Err(bad(format!("{} dimensions, expected {ndim}", bytes[3])));
    }
    let header = 4 + 4 * ndim;
    if bytes.len() < header {
        return Err(bad(format!(
            "{} bytes, shorter than its {header}-byte header",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize)
        .collect();
    let want = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
    let got = bytes.len() - header;
    if got != want {
        return Err(bad(format!(
            "dimensions {dims:?} need {want} bytes of data, the file has {got} (truncated or corrupt)"
        )));
    }
    Ok(Idx {
        dims,
        data: bytes[header..].to_vec(),
    })
}

/// Reads an IDX file, gunzipping it if it starts with the gzip magic number.
///
/// Fails naming the file if it cannot be read, its gzip stream is corrupt, or [`parse`] fails.
pub fn read(path: &Path, ndim: usize) -> Result<Idx, String> {
    let what = path.display().to_string();
    let raw = std::fs::read(path).map_err(|e| format!("{what}: {e}"))?;
    let bytes = if raw.starts_with(&GZIP) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| format!("{what}: corrupt gzip data: {e}"))?;
        out
    } else {
        raw
    };
    parse(&bytes, ndim, &what)
}

/// Images and their labels.
#[derive(Debug, Clone)]
pub struct Split {
    /// Pixels scaled to `[0, 1]`, one row of `features` per image.
    pub images: Vec<f32>,
    /// Class of each image.
    pub labels: Vec<u8>,
    /// Pixels per image.
    pub features: usize,
}

impl Split {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image `i`'s pixels.
    pub fn image(&self, i: usize) -> &[f32] {
        &self.images[i * self.features..(i + 1) * self.features]
    }
}

/// The Fashion-MNIST training and test sets.
#[derive(Debug, Clone)]
pub struct FashionMnist {
    /// 60,000 training images.
    pub train: Split,
    /// 10,000 test images.
    pub test: Split,
    /// Number of classes (one more than the largest label).
    pub classes: usize,
}

impl FashionMnist {
    /// Loads the four IDX files (`train-images-idx3-ubyte`, ... each plain or `.gz`) from `dir`.
    ///
    /// Fails saying how to get them if they are missing, or naming the file that is invalid.
    pub fn load(dir: &Path) -> Result<FashionMnist, String> {
        let train = load_split(dir, "train")?;
        let test = load_split(dir, "t10k")?;
        if train.features != test.features {
            return Err(format!(
                "{}: training images have {} pixels, test images {}",
                dir.display(),
                train.features,
                test.features
            ));
        }
        let classes = train
            .labels
            .iter()
            .chain(&test.labels)
            .max()
            .map_or(0, |&m| m as usize + 1);
        Ok(FashionMnist {
            train,
            test,
            classes,
        })
    }
}

/// `dir/name` or `dir/name.gz`, whichever exists.
fn find(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    [plain, gz]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
            "Fashion-MNIST not found: no {name} or {name}.gz in {}. On Debian or Ubuntu install it \
             with `apt-get install dataset-fashion-mnist` (it goes to {DEFAULT_DATA_DIR}); \
             elsewhere download the four IDX files of Fashion-MNIST (train-images-idx3-ubyte.gz, \
             train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) \
             into a directory and pass it as --data-dir",
            dir.display()
        )
        })
}

fn load_split(dir: &Path, prefix: &str) -> Result<Split, String> {
    let images_path = find(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels_path = find(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let images = read(&images_path, 3)?;
    let labels = read(&labels_path, 1)?;
    if images.dims[0] != labels.dims[0] {
        return Err(format!(
            "{} holds {} images but {} holds {} labels",
            images_path.display(),
            images.dims[0],
            labels_path.display(),
            labels.dims[0]
        ));
    }
    Ok(Split {
        features: images.dims[1] * images.dims[2],
        images: images.data.iter().map(|&p| f32::from(p) / 255.0).collect(),
        labels: labels.data,
    })
}

/// IDX bytes for `dims` and `data` (for tests and for writing small data sets).
pub fn encode(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, UBYTE, dims.len() as u8];
    for &d in dims {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_file_parses_and_round_trips() {
        let bytes = encode(&[2, 3], &[1, 2, 3, 4, 5, 6]);
        let idx = parse(&bytes, 2, "x").unwrap();
        assert_eq!(idx.dims, vec![2, 3]);
        assert_eq!(idx.data, vec![1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn bad_headers_and_lengths_are_named() {
        let good = encode(&[2, 3], &[0; 6]);
        let err = |bytes: &[u8], ndim| parse(bytes, ndim, "f").unwrap_err();
        assert!(err(&good[..good.len() - 1], 2).contains("truncated"));
        assert!(err(&[good.clone(), vec![0]].concat(), 2).contains("the file has 7"));
        assert!(err(&good, 3).contains("2 dimensions, expected 3"));
        let mut magic = good.clone();
        magic[0] = 0x42;
        assert!(err(&magic, 2).contains("magic number"));
        let mut kind = good.clone();
        kind[2] = 0x0D;
        assert!(err(&kind, 2).contains("element type 0x0d"));
        assert!(err(&good[..6], 2).contains("header"));
        assert!(err(&[], 1).contains("shorter than the header"));
    }

    #[test]
    fn gzipped_files_are_read_and_corrupt_ones_are_errors() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("chorus-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes = encode(&[4], &[9, 8, 7, 6]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&bytes).unwrap();
        let gz = gz.finish().unwrap();
        std::fs::write(dir.join("l.gz"), &gz).unwrap();
        assert_eq!(read(&dir.join("l.gz"), 1).unwrap().data, vec![9, 8, 7, 6]);
        std::fs::write(dir.join("bad.gz"), &gz[..gz.len() / 2]).unwrap();
        let e = read(&dir.join("bad.gz"), 1).unwrap_err();
        assert!(e.contains("bad.gz") && e.contains("gzip"), "{e}");
        let e = FashionMnist::load(&dir).unwrap_err();
        assert!(e.contains("apt-get install dataset-fashion-mnist"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
