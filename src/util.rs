//! Small helpers that several modules share and that belong to none of
//! them. This module uses no other module of the crate, so any module may
//! use it without making a cycle (`scripts/cycles`).

/// An error and its causes, as main prints them (`message: cause: cause`):
/// for warnings, which are text.
pub fn with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.ends_with(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// The part of a path after the last `/`.
pub fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_joined_once() {
        let inner = std::io::Error::other("disk full");
        let outer = std::io::Error::other(Wrapped(inner));
        assert_eq!(with_causes(&outer), "writing: disk full");
    }

    #[derive(Debug)]
    struct Wrapped(std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "writing")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn file_name_is_after_the_last_slash() {
        assert_eq!(file_name("/usr/lib/libc.so.6"), "libc.so.6");
        assert_eq!(file_name("a.out"), "a.out");
        assert_eq!(file_name("dir/"), "");
    }
}
