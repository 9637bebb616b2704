//! Fixture rows: an input, the program, the verdict, the output and the counter it moves.

use crate::prelude::*;

/// What must come out.
pub enum Out {
    /// The packet exactly as it went in.
    Untouched,
    /// This packet, byte for byte.
    Packet(P),
    /// Nothing (the verdict drops it); the output is not looked at.
    Dropped,
    /// Whatever the program made of it, not looked at: an input whose checksum is not the
    /// right sum (`Check`) comes out with no right sum to compare (a partial one's rewrite is
    /// right only on a CHECKSUM_PARTIAL skb, which a fixture cannot make).
    Any,
}

pub struct Row {
    pub what: &'static str,
    pub prog: Prog,
    /// The device: `None` for the program's usual one (ext0 or pod0).
    pub dev: Option<u32>,
    pub input: Vec<u8>,
    /// The input is well-formed: its checksums are verified first.
    pub well_formed: bool,
    pub verdict: u32,
    pub out: Out,
    /// The per-device counter this row moves by one (`None`: it moves none).
    pub counted: Option<Reason>,
}

pub fn row(
    what: &'static str,
    prog: Prog,
    input: P,
    verdict: u32,
    out: Out,
    counted: Option<Reason>,
) -> Row {
    Row {
        what,
        prog,
        dev: None,
        input: input.bytes(),
        well_formed: true,
        verdict,
        out,
        counted,
    }
}

/// A row whose packet leaves as it came, passed (`TC_ACT_OK`), no counter moved.
pub fn pass(what: &'static str, prog: Prog, input: P) -> Row {
    row(what, prog, input, TC_ACT_OK, Out::Untouched, None)
}

/// Client `c`'s segment (`flags`) to `frontend` on ext0, DNATed only (the client kept) to a
/// local `backend`, counted `stat`.
pub fn dnat(
    what: &'static str,
    (c, frontend, backend): (&str, &str, &str),
    flags: u8,
    stat: Reason,
) -> Row {
    row(
        what,
        Prog::ExtIngress,
        tcp(c, frontend, flags),
        TC_ACT_OK,
        Out::Packet(tcp(c, backend, flags)),
        Some(stat),
    )
}

/// Client `c`'s SYN to `frontend`, DNATed to a local `backend`: a new flow.
pub fn syn_dnat(what: &'static str, c: &str, frontend: &str, backend: &str) -> Row {
    dnat(what, (c, frontend, backend), TCP_SYN, Reason::New)
}

/// A local `backend`'s segment (`flags`) to client `c` leaving ext0 from `frontend`: a reply.
pub fn reply_from(
    what: &'static str,
    (backend, c, frontend): (&str, &str, &str),
    flags: u8,
) -> Row {
    row(
        what,
        Prog::ExtEgress,
        to_gateway(tcp(backend, c, flags)),
        TC_ACT_OK,
        Out::Packet(to_gateway(tcp(frontend, c, flags))),
        Some(Reason::Reply),
    )
}

/// A local `backend`'s SYN-ACK to client `c`, leaving from `frontend`.
pub fn syn_ack_from(what: &'static str, backend: &str, c: &str, frontend: &str) -> Row {
    reply_from(what, (backend, c, frontend), TCP_SYN | TCP_ACK)
}

/// A client's `input` on ext0, SNATed and sent on to node 2 as `out` (one hop spent), counted
/// `stat`.
pub fn routed_to_node2(what: &'static str, input: P, out: P, stat: Reason) -> Row {
    row(
        what,
        Prog::ExtIngress,
        input,
        TC_ACT_REDIRECT,
        Out::Packet(out.macs(NODE2_MAC, EXT_MAC).ttl(63)),
        Some(stat),
    )
}

/// A row whose input is raw bytes (malformed on purpose, or not IP).
pub fn raw_row(what: &'static str, prog: Prog, input: Vec<u8>, counted: Option<Reason>) -> Row {
    Row {
        what,
        prog,
        dev: None,
        input,
        well_formed: false,
        verdict: TC_ACT_OK,
        out: Out::Untouched,
        counted,
    }
}

/// Runs the rows in order against `dp`, checking each.
pub fn run_rows(dp: &Dp, rows: Vec<Row>) {
    for r in rows {
        let dev = r.dev.unwrap_or_else(|| dp.ifindex_of(r.prog));
        let input = &r.input;
        if r.well_formed {
            verify_checksums(input)
                .unwrap_or_else(|e| panic!("{}: the input's {e} is wrong", r.what));
        }
        let before = dp.dev_stats_of(dev);
        let before_none = dp.dev_stats_of(0);
        let (verdict, out, _) = dp.run_on(r.prog, dev, input, 1);
        let after = dp.dev_stats_of(dev);
        // A packet's event is counted once, under its device: without a device only what
        // the backend choice counts, which it is not told the device for.
        let choice = [
            Reason::AffinityHit,
            Reason::AffinityStale,
            Reason::RetriedMissingEntry,
        ];
        let moved_none: Vec<Reason> = dp
            .dev_stats_of(0)
            .into_iter()
            .filter(|(reason, n)| before_none.get(reason) != Some(n) && !choice.contains(reason))
            .map(|(reason, _)| reason)
            .collect();
        assert!(
            moved_none.is_empty(),
            "{}: counted without a device: {moved_none:?}",
            r.what
        );
        let mut moved: BTreeMap<Reason, u64> = BTreeMap::new();
        for (reason, n) in &after {
            let d = n - before.get(reason).copied().unwrap_or(0);
            if d != 0 {
                moved.insert(*reason, d);
            }
        }
        assert_eq!(
            verdict, r.verdict,
            "{}: verdict (0 ok, 2 shot, 7 redirect)\nout: {out:02x?}\ncounters moved: {moved:?}",
            r.what,
        );
        match &r.out {
            Out::Untouched => assert_eq!(&out, input, "{}: must pass untouched", r.what),
            Out::Packet(want) => {
                let want = want.bytes();
                if out != want {
                    panic!(
                        "{}: output differs\n got: {}\nwant: {}\n{}",
                        r.what,
                        hex(&out),
                        hex(&want),
                        diff(&out, &want)
                    );
                }
                verify_checksums(&out).unwrap_or_else(|e| panic!("{}: {e} is wrong", r.what));
            }
            Out::Dropped | Out::Any => {}
        }
        let want: BTreeMap<Reason, u64> = r.counted.into_iter().map(|c| (c, 1)).collect();
        assert_eq!(moved, want, "{}: per-device counters moved", r.what,);
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn diff(got: &[u8], want: &[u8]) -> String {
    let mut s = String::new();
    for i in 0..got.len().max(want.len()) {
        let (g, w) = (got.get(i), want.get(i));
        if g != w {
            s += &format!("  byte {i}: got {g:02x?} want {w:02x?}\n");
        }
    }
    s
}
