//! The members of a Unix `ar` archive (`libc.a`), in order. Member names
//! need not be unique (musl has two `free.lo`), so members are listed, not
//! looked up by name. GNU long names (`//`) are resolved; the symbol index
//! (`/`) is skipped: every member is read anyway.

/// One member: its name and its bytes.
#[derive(Debug)]
pub struct Member<'a> {
    pub name: String,
    pub data: &'a [u8],
}

const MAGIC: &[u8] = b"!<arch>\n";
const HEADER: usize = 60;

/// Every member of the archive, or why the bytes are not one.
pub fn members(bytes: &[u8]) -> Result<Vec<Member<'_>>, String> {
    if !bytes.starts_with(MAGIC) {
        return Err("not an ar archive".into());
    }
    let mut at = MAGIC.len();
    let mut long_names: &[u8] = &[];
    let mut out = Vec::new();
    while at + HEADER <= bytes.len() {
        let header = &bytes[at..at + HEADER];
        if &header[58..60] != b"`\n" {
            return Err(format!("bad member header at offset {at}"));
        }
        let field =
            |r: std::ops::Range<usize>| String::from_utf8_lossy(&header[r]).trim().to_string();
        let size: usize = field(48..58)
            .parse()
            .map_err(|_| format!("bad member size at offset {at}"))?;
        let start = at + HEADER;
        let data = bytes
            .get(start..start.saturating_add(size))
            .ok_or_else(|| format!("member at offset {at} runs past the end"))?;
        let raw = field(0..16);
        if raw == "//" {
            long_names = data;
        } else if raw != "/" && raw != "/SYM64/" {
            let name = match raw.strip_prefix('/').and_then(|n| n.parse::<usize>().ok()) {
                Some(offset) => {
                    let rest = long_names.get(offset..).unwrap_or(&[]);
                    let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
                    String::from_utf8_lossy(&rest[..end])
                        .trim_end_matches('/')
                        .to_string()
                }
                None => raw.trim_end_matches('/').to_string(),
            };
            out.push(Member { name, data });
        }
        // Members start at even offsets.
        at = start + size + (size & 1);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(name: &str, size: usize) -> Vec<u8> {
        let mut h = format!("{name:<16}{:<12}{:<6}{:<6}{:<8}{size:<10}`\n", 0, 0, 0, 644);
        assert_eq!(h.len(), 60);
        std::mem::take(&mut h).into_bytes()
    }

    #[test]
    fn lists_members_with_long_and_repeated_names() {
        let mut ar = MAGIC.to_vec();
        let names = b"a_rather_long_member_name.o/\n";
        ar.extend(header("//", names.len()));
        ar.extend(names);
        ar.push(b'\n'); // odd size: padding
        ar.extend(header("free.lo/", 2));
        ar.extend(b"ab");
        ar.extend(header("free.lo/", 3));
        ar.extend(b"cde\n");
        ar.extend(header("/0", 1));
        ar.extend(b"x\n");
        let m = members(&ar).unwrap();
        let names: Vec<&str> = m.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["free.lo", "free.lo", "a_rather_long_member_name.o"]);
        assert_eq!(m[1].data, b"cde");
        assert!(members(b"not an archive").is_err());
    }
}
