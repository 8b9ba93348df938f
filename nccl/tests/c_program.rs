//! A C program compiled against NVIDIA's `nccl.h` (from the NCCL wheel PyTorch brings, with
//! its CUDA headers), linked to this library as `libnccl.so.2` and run at W = 1..4 as
//! processes; and the set of NCCL functions PyTorch imports against what this library
//! exports. Both need torch 2.x's Python (`CHORUS_TORCH_PYTHON`), a C compiler and `nm`; where
//! one is missing they say which and skip (`CHORUS_REQUIRE_NCCL_HEADER=1` makes that a failure).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where torch's Python keeps its packages, or why there is none.
fn site_packages() -> Result<PathBuf, String> {
    let python = std::env::var(chorus_env::CHORUS_TORCH_PYTHON)
        .map_err(|_| "CHORUS_TORCH_PYTHON is not set (a Python with torch 2.x)".to_string())?;
    let out = Command::new(&python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Skips the test, saying why, unless skipping is an error here.
fn skip(why: &str) {
    assert!(
        std::env::var(chorus_env::CHORUS_REQUIRE_NCCL_HEADER).as_deref() != Ok("1"),
        "CHORUS_REQUIRE_NCCL_HEADER=1, but {why}"
    );
    eprintln!("skipping: {why}");
}

/// This library as built for these tests (`target/<profile>/deps/libnccl.so`, beside the
/// test binary).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.with_file_name("libnccl.so");
    assert!(lib.exists(), "no {}", lib.display());
    lib
}

/// The include directories nccl.h needs, or why they are not there.
fn headers(site: &Path) -> Result<Vec<PathBuf>, String> {
    let nccl = site.join("nvidia/nccl/include");
    let cuda = site.join("nvidia/cu13/include");
    for needed in [
        nccl.join("nccl.h"),
        cuda.join("cuda_runtime.h"),
        cuda.join("crt/host_config.h"),
    ] {
        if !needed.exists() {
            return Err(format!(
                "no {} (pip install nvidia-nccl-cu13 nvidia-cuda-crt)",
                needed.display()
            ));
        }
    }
    Ok(vec![nccl, cuda])
}

/// `check.c` built against the header, linked to this library under NCCL's soname.
fn build(site: &Path) -> Result<PathBuf, String> {
    compile(site, "check", &[])
}

/// Compiles `tests/c/NAME.c` against the headers and this library (plus `libs`), into an
/// executable beside a `libnccl.so.2` that is this library.
fn compile(site: &Path, name: &str, libs: &[String]) -> Result<PathBuf, String> {
    let includes = headers(site)?;
    let dir = std::env::temp_dir().join(format!("chorus-nccl-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let soname = dir.join("libnccl.so.2");
    let _ = std::fs::remove_file(&soname);
    std::os::unix::fs::symlink(library(), &soname).unwrap();
    let exe = dir.join(name);
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let mut cc = Command::new("cc");
    for i in &includes {
        cc.arg("-I").arg(i);
    }
    let out = cc
        .args(["-Wall", "-Werror"])
        .arg(&source)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", dir.display()))
        .arg("-l:libnccl.so.2")
        .args(libs)
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .output()
        .map_err(|e| format!("no C compiler (cc): {e}"))?;
    assert!(
        out.status.success(),
        "cc {name}.c failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(exe)
}

/// The program tools/gpu-check.sh runs on device memory compiles and links against CUDA's
/// runtime and this library (it runs only where there is a GPU).
#[test]
fn the_device_program_builds() {
    let built = site_packages().and_then(|site| {
        let runtime = site.join("nvidia/cu13/lib");
        if !runtime.join("libcudart.so.13").exists() {
            return Err(format!("no {}/libcudart.so.13", runtime.display()));
        }
        let libs = [
            format!("-L{}", runtime.display()),
            "-l:libcudart.so.13".to_string(),
        ];
        compile(&site, "device", &libs)
    });
    match built {
        Ok(exe) => assert!(exe.exists()),
        Err(why) => skip(&why),
    }
}

#[test]
fn a_c_program_on_nvidias_header_runs_on_this_library() {
    let built = site_packages().and_then(|site| build(&site));
    let exe = match built {
        Ok(exe) => exe,
        Err(why) => return skip(&why),
    };
    // The header's ABI is this library's.
    let layout = Command::new(&exe).arg("layout").output().unwrap();
    let layout = String::from_utf8_lossy(&layout.stdout).into_owned();
    let header: i32 = layout.split(' ').nth(1).unwrap().parse().unwrap();
    let expected = format!(
        "header {header} library {} config 96 blocking 16 commName 48 uniqueId {} float8e4m3 10 avg 4 timeout 8\n",
        nccl::abi::VERSION_CODE,
        nccl::abi::UNIQUE_ID_BYTES
    );
    assert_eq!(layout, expected, "the header is NCCL {header}");
    for w in 1..=4 {
        let (stdout, _) = run_ok(&exe, &[&w.to_string()], &[]);
        for r in 0..w {
            assert!(
                stdout.contains(&format!("rank {r} of {w} ok")),
                "W={w}: {stdout}"
            );
        }
    }
    // A rank killed: the survivors' next call and async error name it, and they shrink.
    let (stdout, _) = run_ok(&exe, &["kill", "3"], &[]);
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("rank {r} of 3 survived")),
            "{stdout}"
        );
    }
    // NCCL_DEBUG=INFO: the tuner's pick for the program's all-reduce, and its failed call.
    let (_, stderr) = run_ok(&exe, &["2"], &[("NCCL_DEBUG", "INFO")]);
    assert!(
        stderr.contains("allreduce 16396 B on 2 ranks: ") && stderr.contains(" -> "),
        "{stderr}"
    );
    assert!(
        stderr.contains("NCCL WARN ncclAllReduce: data type 10 (ncclFloat8e4m3)"),
        "{stderr}"
    );
}

/// Runs `exe` with `args` and `env` (and a 60 s timeout for Chorus's waits), asserting that it
/// succeeded; its standard output and error.
fn run_ok(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let out = Command::new(exe)
        .args(args)
        .envs(env.iter().copied())
        .env("CHORUS_TIMEOUT", "60")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "{args:?}: {}\n{stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// The `nccl*` functions `nm` lists for `lib`, defined (`--defined-only`) or needed.
fn functions(lib: &Path, which: &str) -> Result<Vec<String>, String> {
    let out = Command::new("nm")
        .args(["-D", which])
        .arg(lib)
        .output()
        .map_err(|e| format!("no nm: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|name| name.starts_with("nccl"))
        .map(str::to_string)
        .collect())
}

#[test]
fn every_nccl_function_torch_imports_is_exported() {
    let torch = match site_packages() {
        Ok(site) => site.join("torch/lib/libtorch_cuda.so"),
        Err(why) => return skip(&why),
    };
    if !torch.exists() {
        return skip(&format!("no {} (a CPU-only torch)", torch.display()));
    }
    let (wanted, ours) = match (
        functions(&torch, "--undefined-only"),
        functions(&library(), "--defined-only"),
    ) {
        (Ok(w), Ok(o)) => (w, o),
        (Err(why), _) | (_, Err(why)) => return skip(&why),
    };
    assert!(wanted.len() > 20, "torch imports only {wanted:?}");
    let missing: Vec<&String> = wanted.iter().filter(|f| !ours.contains(f)).collect();
    assert!(
        missing.is_empty(),
        "torch imports {missing:?}, which this library lacks"
    );
}
