fn main() {
    // Debian's libunwind-ptrace links against liblzma for compressed
    // .gnu_debugdata sections but does not list it in its pkg-config file.
    println!("cargo:rustc-link-lib=dylib=lzma");
    println!("cargo:rerun-if-changed=build.rs");
}
