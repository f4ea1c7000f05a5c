//! The pictures as a user gets them: the real binary writes each PNG (`inspect --png`,
//! `status --png`), the test decodes it and looks for what must be in it: its size, text, the
//! waveform, the colour scale, the bars per split, the arrivals, the out-of-water mark.

use crate::common::*;
use ailhd::plot::{palette, OUT_OF_WATER};
use std::path::Path;
use std::time::{Duration, Instant};

struct Picture {
    w: usize,
    h: usize,
    rgb: Vec<[u8; 3]>,
}

fn load(path: &Path) -> Picture {
    let file = std::fs::File::open(path)
        .unwrap_or_else(|e| panic!("{}: the picture was not written: {e}", path.display()));
    let mut dec = png::Decoder::new(std::io::BufReader::new(file));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().unwrap();
    let mut buf = vec![0u8; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("{}: unexpected colour type {other:?}", path.display()),
    };
    let rgb = buf[..info.buffer_size()]
        .chunks(channels)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    Picture {
        w: info.width as usize,
        h: info.height as usize,
        rgb,
    }
}

impl Picture {
    fn at(&self, x: usize, y: usize) -> [u8; 3] {
        self.rgb[y * self.w + x]
    }
    /// Pixels in the box `x0..x1, y0..y1` within `tol` of `c` on every channel.
    fn count_in(
        &self,
        (x0, x1): (usize, usize),
        (y0, y1): (usize, usize),
        c: [u8; 3],
        tol: u8,
    ) -> usize {
        let mut n = 0;
        for y in y0..y1.min(self.h) {
            for x in x0..x1.min(self.w) {
                let p = self.at(x, y);
                if (0..3).all(|i| p[i].abs_diff(c[i]) <= tol) {
                    n += 1;
                }
            }
        }
        n
    }
    fn count(&self, c: [u8; 3], tol: u8) -> usize {
        self.count_in((0, self.w), (0, self.h), c, tol)
    }
    fn distinct(&self) -> usize {
        self.rgb
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len()
    }
    fn assert_big_enough(&self) {
        assert!(
            self.w >= 800 && self.h >= 500,
            "picture is {}x{}, smaller than 800x500",
            self.w,
            self.h
        );
    }
}

fn rgb(c: plotters::style::RGBColor) -> [u8; 3] {
    [c.0, c.1, c.2]
}

const WHITE: [u8; 3] = [255, 255, 255];
/// The ends of the colour scale (viridis).
const SCALE_LOW: [u8; 3] = [68, 1, 84];
const SCALE_HIGH: [u8; 3] = [254, 232, 37];

#[test]
fn inspect_draws_waveform_spectrogram_features_colour_scale_and_out_of_water_mark() {
    let world = World::new("");
    let dir = world.rec().join("LEAK");
    std::fs::create_dir_all(&dir).unwrap();
    // synth::file_name gives gain 1 dB when (seed + index) % 23 == 0.
    let in_water = dir.join(ailhd::synth::file_name(1, 23));
    let out_of_water = dir.join(ailhd::synth::file_name(0, 23));
    assert!(out_of_water.to_string_lossy().ends_with("~1.wav"));
    assert!(in_water.to_string_lossy().ends_with("~100.wav"));
    for (i, p) in [&in_water, &out_of_water].iter().enumerate() {
        let clip = ailhd::synth::clip("LEAK", i as u64, 4096, 10.0);
        std::fs::write(p, ailhd::synth::wav_pcm16(&clip, 4096)).unwrap();
    }

    let mut pictures = Vec::new();
    for wav in [&in_water, &out_of_water] {
        let png = wav.with_extension("png");
        let o = world.run(&[
            "inspect",
            "--json",
            "--png",
            png.to_str().unwrap(),
            wav.to_str().unwrap(),
        ]);
        let info: serde_json::Value = serde_json::from_str(&ok(&o)).unwrap();
        assert_eq!(info["label"], "LEAK", "{info}");
        pictures.push(load(&png));
    }
    for pic in &pictures {
        pic.assert_big_enough();
        // Text in the title block (the embedded font drew something dark up there).
        let dark = pic.count_in((0, pic.w), (0, 100), [30, 30, 30], 30);
        assert!(
            dark > 500,
            "no title text: {dark} dark pixels in the title block"
        );
        // The waveform, drawn in blue.
        let blue = pic.count(rgb(palette(0)), 0);
        assert!(blue > 5_000, "no waveform: {blue} blue pixels");
        // Heatmaps on a colour scale make hundreds of colours; a blank picture has a handful
        // and a greyscale one at most 256.
        assert!(pic.distinct() > 400, "only {} colours", pic.distinct());
        // The colour bars (right-hand strip) run from one end of the scale to the other.
        let strip = (pic.w - 110, pic.w);
        let low = pic.count_in(strip, (0, pic.h), SCALE_LOW, 20);
        let high = pic.count_in(strip, (0, pic.h), SCALE_HIGH, 20);
        assert!(
            low > 100 && high > 100,
            "no colour scale in the right-hand strip: {low} dark, {high} bright pixels"
        );
    }
    // Out of the water: a red frame and red text; in the water: neither.
    let red = rgb(OUT_OF_WATER);
    let (wet, dry) = (&pictures[0], &pictures[1]);
    assert_eq!(wet.at(2, 2), WHITE);
    assert_eq!(dry.at(2, 2), red);
    assert_eq!(dry.at(dry.w - 3, dry.h - 3), red);
    let red_text = |p: &Picture| p.count_in((10, p.w - 10), (10, 120), red, 40);
    assert_eq!(red_text(wet), 0, "red text on an in-water recording");
    assert!(red_text(dry) > 200, "no out-of-water banner");
}

/// A small tree with one out-of-water recording (`NORMAL`, index 18 of seed 5), rebuilt.
fn rebuilt_world() -> World {
    rebuilt_world_with("")
}

fn rebuilt_world_with(config: &str) -> World {
    let world = World::new(config);
    let written = ailhd::synth::write_tree(&world.rec(), &["LEAK", "NORMAL"], 12, 5).unwrap();
    assert_eq!(
        written
            .iter()
            .filter(|p| p.to_string_lossy().ends_with("~1.wav"))
            .count(),
        1
    );
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    world
}

#[test]
fn status_draws_rows_per_split_and_label_gains_and_arrivals() {
    let world = rebuilt_world();
    let png = world.dir.path().join("status.png");
    let text = ok(&world.run(&["status", "--png", png.to_str().unwrap()]));
    assert!(text.contains("picture:"), "{text}");
    let pic = load(&png);
    pic.assert_big_enough();
    let dark = pic.count_in((0, pic.w), (0, 90), [30, 30, 30], 30);
    assert!(dark > 500, "no title text: {dark} dark pixels");
    // Bars per split: training (most rows) in the first palette colour, far more than its
    // legend swatch.
    let training = pic.count(rgb(palette(0)), 0);
    assert!(training > 3_000, "training bars: {training} pixels");
    // The one out-of-water recording has its own red bar in the gain distribution.
    let red = pic.count(rgb(OUT_OF_WATER), 0);
    assert!(red > 150, "no out-of-water gain bar: {red} red pixels");
    // Arrivals: a cumulative line per label (LEAK is label 2, NORMAL 3 of the default list),
    // longer than its legend mark.
    for label in [2, 3] {
        let line = pic.count(rgb(palette(label + 3)), 0);
        assert!(
            line > 400,
            "no arrivals line for label {label}: {line} pixels"
        );
    }
    // Nothing left to draw from: a clear error, no picture.
    let empty = World::new("");
    let o = empty.run(&[
        "status",
        "--png",
        empty.dir.path().join("x.png").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!empty.dir.path().join("x.png").exists());
    // A path that cannot be written, or a name that is not a picture's: the error says which
    // and why, in words (not the drawing library's internals).
    let nowhere = world.dir.path().join("no such folder").join("status.png");
    let not_a_picture = world.dir.path().join("status.txt");
    for (out, why) in [
        (&nowhere, "No such file or directory"),
        (&not_a_picture, "not recognized as an image format"),
    ] {
        let o = world.run(&["status", "--png", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("cannot write {}: ", out.display()))
                && err.contains(why)
                && !err.contains("Error("),
            "{err}"
        );
        assert!(!out.exists());
    }
}

#[test]
fn status_png_reads_the_outputs_while_the_service_appends() {
    let world = rebuilt_world();
    let before = world.status_json();
    let rows = |s: &serde_json::Value| -> u64 {
        s["splits"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v["rows"].as_u64().unwrap())
            .sum()
    };
    let child = world
        .cmd(&["run"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let pid = child.id();
    let mut service = Stop(child);
    // A new recording while it runs; wait until the service's snapshot counts it.
    let t = Instant::now();
    let extra = world
        .rec()
        .join("LEAK")
        .join(ailhd::synth::file_name(500, 5));
    std::fs::write(
        &extra,
        ailhd::synth::wav_pcm16(&ailhd::synth::clip("LEAK", 999, 4096, 10.0), 4096),
    )
    .unwrap();
    loop {
        let o = world.run(&["status", "--json"]);
        if o.status.success() {
            let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            if s["service"]["pid"] == pid && rows(&s) == rows(&before) + 1 {
                break;
            }
        }
        assert!(
            service.0.try_wait().unwrap().is_none(),
            "the service stopped"
        );
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the service never committed the new recording"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The picture reads the HDF5 files the service holds open (SWMR).
    let png = world.dir.path().join("live.png");
    ok(&world.run(&["status", "--png", png.to_str().unwrap()]));
    let pic = load(&png);
    pic.assert_big_enough();
    assert!(pic.count(rgb(palette(0)), 0) > 3_000);
    // SIGTERM, as systemd stops the service. SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    assert!(
        exit_within(&mut service.0, Duration::from_secs(30)).is_some(),
        "the service did not stop"
    );
}

#[test]
fn status_png_reads_the_npy_columns_when_hdf5_output_is_off() {
    let world = rebuilt_world_with("[outputs]\nhdf5 = false\n");
    assert!(!world.out().join("TRAINING_DATASET.H5").exists());
    let png = world.dir.path().join("status.png");
    ok(&world.run(&["status", "--png", png.to_str().unwrap()]));
    let pic = load(&png);
    pic.assert_big_enough();
    assert!(pic.count(rgb(palette(0)), 0) > 3_000, "no training bars");
    assert!(pic.count(rgb(OUT_OF_WATER), 0) > 150, "no out-of-water bar");
}
