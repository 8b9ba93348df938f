//! What training reports: the epoch line, the JSON log and the loss/accuracy curves.

use std::path::Path;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::file::write_atomically;

/// One epoch's results, averaged over all ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochLog {
    /// Epoch number, from 1.
    pub epoch: u64,
    /// Mean cross-entropy over the epoch's training batches.
    pub train_loss: f64,
    /// Fraction of training samples classified right during the epoch.
    pub train_acc: f64,
    /// Mean cross-entropy on the test set after the epoch.
    pub test_loss: f64,
    /// Fraction of the test set classified right after the epoch.
    pub test_acc: f64,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// Training samples per second, all ranks together.
    pub samples_per_sec: f64,
    /// Each rank's figures for the epoch, by rank.
    #[serde(default)]
    pub ranks: Vec<RankLog>,
}

/// One rank's figures over an epoch (or a `--bench` run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankLog {
    /// Its rank in the job.
    pub rank: usize,
    /// Its replica (data-parallel index) and pipeline stage.
    pub replica: usize,
    /// Its pipeline stage.
    pub stage: usize,
    /// The layers its stage holds, `[first, end)`.
    pub layers: [usize; 2],
    /// Samples of its replica it passed through its stage per second.
    pub samples_per_sec: f64,
    /// Measured bubble: the fraction of its pipeline time spent waiting for neighbours.
    pub bubble: f64,
    /// The schedule's theoretical bubble, `(P - 1) / (M + P - 1)`.
    pub bubble_theory: f64,
    /// Bytes held for parameters.
    pub param_bytes: u64,
    /// Bytes held for gradients.
    pub grad_bytes: u64,
    /// Bytes held for optimizer state.
    pub optimizer_bytes: u64,
}

impl RankLog {
    /// One line: where the rank sits, its throughput, bubble and memory.
    pub fn line(&self) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        format!(
            "rank {}  replica {} stage {} layers {}..{}  samples/s {:.0}  bubble {:.3} (theory {:.3})  MB params {:.2} grads {:.2} optimizer {:.2}",
            self.rank,
            self.replica,
            self.stage,
            self.layers[0],
            self.layers[1],
            self.samples_per_sec,
            self.bubble,
            self.bubble_theory,
            mb(self.param_bytes),
            mb(self.grad_bytes),
            mb(self.optimizer_bytes)
        )
    }
}

impl EpochLog {
    /// The epoch's last line: plain words and numbers, the test accuracy last.
    pub fn line(&self) -> String {
        format!(
            "epoch {}  train_loss {:.4}  train_acc {:.4}  test_loss {:.4}  samples/s {:.0}  test_acc {:.4}",
            self.epoch,
            self.train_loss,
            self.train_acc,
            self.test_loss,
            self.samples_per_sec,
            self.test_acc
        )
    }
}

/// Writes `{"config": config, "epochs": [...]}` to `path`, atomically.
///
/// Fails naming the file on an I/O error.
pub fn write_log(
    path: &Path,
    config: &serde_json::Value,
    epochs: &[EpochLog],
) -> Result<(), String> {
    let value = serde_json::json!({ "config": config, "epochs": epochs });
    let text = serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?;
    write_atomically(path, text.as_bytes())
}

/// A chart panel: title, two lines (value, name, colour) and the y range.
type Panel = (
    &'static str,
    [(fn(&EpochLog) -> f64, &'static str, RGBColor); 2],
    std::ops::Range<f64>,
);

/// Fonts tried for the chart's text, in order; the chart has no text without one.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers the first font found as "sans-serif"; whether one was.
fn load_font() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        FONTS.iter().any(|path| {
            std::fs::read(path).is_ok_and(|bytes| {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            })
        })
    })
}

/// Draws loss (left) and accuracy (right) per epoch, train and test, into a PNG at `path`.
///
/// Fails naming the file if it cannot be drawn or written.
pub fn plot(path: &Path, epochs: &[EpochLog]) -> Result<(), String> {
    let text = load_font();
    let tmp = path.with_extension(format!("tmp.{}.png", std::process::id()));
    let fail = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    {
        let root = BitMapBackend::new(&tmp, (1200, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let panels = root.split_evenly((1, 2));
        let last = epochs.last().map_or(1, |e| e.epoch.max(1));
        let loss_max = epochs
            .iter()
            .flat_map(|e| [e.train_loss, e.test_loss])
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.1;
        let acc_min = epochs
            .iter()
            .flat_map(|e| [e.train_acc, e.test_acc])
            .fold(1.0f64, f64::min)
            .min(0.9)
            - 0.05;
        let series: [Panel; 2] = [
            (
                "loss",
                [
                    (|e| e.train_loss, "train", BLUE),
                    (|e| e.test_loss, "test", RED),
                ],
                0.0..loss_max,
            ),
            (
                "accuracy",
                [
                    (|e| e.train_acc, "train", BLUE),
                    (|e| e.test_acc, "test", RED),
                ],
                acc_min.max(0.0)..1.0,
            ),
        ];
        for (panel, (title, lines, y)) in panels.iter().zip(series) {
            let mut builder = ChartBuilder::on(panel);
            builder.margin(20);
            if text {
                builder
                    .caption(title, ("sans-serif", 22))
                    .x_label_area_size(40)
                    .y_label_area_size(60);
            }
            let mut chart = builder
                .build_cartesian_2d(0.5f64..last as f64 + 0.5, y)
                .map_err(|e| fail(&e))?;
            let mut mesh = chart.configure_mesh();
            if text {
                mesh.x_desc("epoch")
                    .x_labels(last.min(20) as usize)
                    .x_label_formatter(&|x| format!("{x:.0}"));
            } else {
                mesh.x_labels(0).y_labels(0);
            }
            mesh.draw().map_err(|e| fail(&e))?;
            for (pick, name, color) in lines {
                let points: Vec<(f64, f64)> =
                    epochs.iter().map(|e| (e.epoch as f64, pick(e))).collect();
                let drawn = chart
                    .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                    .map_err(|e| fail(&e))?;
                if text {
                    drawn.label(name).legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                }
                chart
                    .draw_series(
                        points
                            .into_iter()
                            .map(|p| Circle::new(p, 3, color.filled())),
                    )
                    .map_err(|e| fail(&e))?;
            }
            if text {
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| fail(&e))?;
            }
        }
        root.present().map_err(|e| fail(&e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| fail(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(epoch: u64, acc: f64) -> EpochLog {
        EpochLog {
            epoch,
            train_loss: 1.0 / epoch as f64,
            train_acc: acc,
            test_loss: 1.1 / epoch as f64,
            test_acc: acc - 0.01,
            train_seconds: 1.0,
            samples_per_sec: 60000.0,
            ranks: vec![RankLog {
                rank: 1,
                replica: 0,
                stage: 1,
                layers: [2, 3],
                samples_per_sec: 3000.0,
                bubble: 0.25,
                bubble_theory: 0.2,
                param_bytes: 4_000_000,
                grad_bytes: 1_000_000,
                optimizer_bytes: 500_000,
            }],
        }
    }

    #[test]
    fn the_epoch_line_ends_with_the_test_accuracy() {
        let line = log(3, 0.875).line();
        assert!(line.starts_with("epoch 3  train_loss 0.3333"), "{line}");
        assert!(line.ends_with("test_acc 0.8650"), "{line}");
        let rank = log(3, 0.875).ranks[0].line();
        assert!(
            rank.contains("bubble 0.250 (theory 0.200)")
                && rank.ends_with("params 4.00 grads 1.00 optimizer 0.50"),
            "{rank}"
        );
    }

    #[test]
    fn log_and_curves_are_written() {
        let dir = std::env::temp_dir().join(format!("chorus-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let epochs = vec![log(1, 0.8), log(2, 0.85)];
        write_log(
            &dir.join("log.json"),
            &serde_json::json!({"lr": 0.05}),
            &epochs,
        )
        .unwrap();
        let back: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("log.json")).unwrap()).unwrap();
        assert_eq!(back["epochs"][1]["test_acc"], 0.84);
        assert_eq!(back["config"]["lr"], 0.05);
        assert_eq!(back["epochs"][0]["ranks"][0]["bubble_theory"], 0.2);
        plot(&dir.join("curves.png"), &epochs).unwrap();
        let png = std::fs::read(dir.join("curves.png")).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
