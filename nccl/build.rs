//! The shared library answers to NCCL's soname, so a program linked against NCCL, or a
//! loader looking for `libnccl.so.2`, takes this one.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}
