//! The TCP checksum of a segment that would start a flow, checked as the kernel's conntrack
//! checks it (`nf_checksum`): a segment the device verified (CHECKSUM_UNNECESSARY) or that a
//! local sender left to a device (CHECKSUM_PARTIAL) counts as valid; any other is summed here.
//! A corrupted or forged SYN then creates no state and reaches no backend. Known flows' segments
//! are not checked: their checksum is the receiving stack's to verify, and checking them would
//! cost every packet.
//!
//! A tc program sees the skb's checksum state only in part: `bpf_csum_level` answers for
//! CHECKSUM_UNNECESSARY alone, and nothing tells CHECKSUM_PARTIAL from CHECKSUM_NONE. A
//! CHECKSUM_PARTIAL segment (a pod's, or one from another namespace through a veth) carries in
//! its checksum field the folded sum of its pseudo-header, not complemented, for the device to
//! finish: a segment whose field holds exactly that is taken as one. A sender that forges it
//! (one in 65,536 random ones does too) gets a flow for a segment the backend's stack then
//! drops: no more than a correct checksum would get it.
//!
//! The XDP program sees no checksum state at all: there a segment is valid only when summed
//! here. One whose field holds its partial sum, or that this cannot read, is left to tc,
//! which can tell.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use svc_common::IPPROTO_TCP;

use crate::{
    csum,
    ctx::Ctx,
    pkt::{self, Pkt, L3},
};

/// How much of the segment one round reads: with the word of zeros after it, what one
/// `bpf_csum_diff` call sums at most (512 bytes). A multiple of 4, so that `& 0x1fc` bounds
/// it for the verifier without changing it.
const CHUNK: u32 = 508;
const CHUNKS: u32 = 4;
/// Segments longer than this (a SYN carrying more TCP Fast Open data than an Ethernet MTU
/// holds: jumbo frames only) are not checked: they go on, for the backend's stack to check.
pub const MAX_LEN: u32 = CHUNK * CHUNKS;

/// A chunk of the segment and a word of zeros after it: `bpf_csum_diff` sums whole words. In a
/// map of its own rather than in the scratch space, whose layout the external ingress's frames
/// depend on; per CPU, as a tc program runs to completion on one.
#[btf_map]
static SVC_CSUM_BUF: PerCpuArray<[u8; CHUNK as usize + 4], 1> = PerCpuArray::new();

/// Whether the TCP segment `p` has a checksum a receiver would accept; true too for what this
/// does not check (above, and `MAX_LEN`, first fragments). At XDP (`Ctx::XDP`) false for a
/// partial sum too: tc judges it. A function of its own, called only off the external
/// ingress's deepest call chain.
#[inline(never)]
pub fn valid<C: Ctx>(ctx: &C, p: &Pkt) -> bool {
    if ctx.csum_verified() {
        return true;
    }
    if p.first_frag != 0 {
        // The rest of the segment is in later fragments: no sum to check.
        return true;
    }
    let len = (L3 + p.ip_len).saturating_sub(p.l4_off);
    let pseudo = pseudo_sum(p, len);
    let Some(check) = pkt::header::<2>(ctx, p.csum_off()) else {
        return false;
    };
    if u16::from_ne_bytes(check) == csum::fold(pseudo) {
        return !C::XDP;
    }
    // Unread: valid at tc (as ever), left to tc at XDP, which stores nothing it did not sum.
    if len > MAX_LEN {
        return !C::XDP;
    }
    let Some(buf) = SVC_CSUM_BUF.get_ptr_mut(0) else {
        return !C::XDP;
    };
    let buf = buf.cast::<u8>();
    let mut sum = pseudo;
    let mut done = 0u32;
    for _ in 0..CHUNKS {
        let left = len - done;
        // The verifier needs `n`'s bounds on `n` itself, which LLVM, left to prove them from
        // `left`, would move or drop: hence the opaque `m`. Its test for 0 is the loop's end;
        // `n` is `m` (1 to `CHUNK`) written so that its bounds, 1 to 512, follow from the
        // arithmetic alone: older verifiers (Debian 12's 6.1) learn no lower bound from
        // `m != 0` and refuse a length that may be 0 for `bpf_skb_load_bytes`
        // (`cargo xtask kernel-smoke`).
        let m = core::hint::black_box(if left > CHUNK { CHUNK } else { left });
        if m == 0 {
            break;
        }
        let n = ((m - 1) & 0x1ff) + 1;
        // The whole words, and the word the tail bytes (if any) go in, zero past them: summed
        // whole, it adds nothing when there are none.
        let words = (n & 0x1fc) + 4;
        // SAFETY: `words` is at most the buffer's size; the helper checks the packet's bounds
        // and writes `n` bytes, fewer than `words`, into the buffer.
        let loaded = unsafe {
            core::ptr::write_unaligned(buf.add(words as usize - 4).cast::<u32>(), 0);
            ctx.load_bytes(p.l4_off + done, buf, n)
        };
        if !loaded {
            return false;
        }
        // SAFETY: the buffer holds `words` bytes the verifier knows.
        let r = unsafe { csum::sum(buf, words, sum) };
        if r < 0 {
            return !C::XDP;
        }
        sum = r as u32;
        done += n;
    }
    csum::fold(sum) == 0xffff
}

/// The partial sum of the TCP pseudo-header for a segment of `len` bytes. Wrong above 65,535
/// (IPv6's 32-bit length is taken as its lower half), where only the partial form's test
/// uses it, and a miss there is accepted anyway (`MAX_LEN`).
#[inline(always)]
fn pseudo_sum(p: &Pkt, len: u32) -> u32 {
    let word = |a: &[u8; 16], i: usize| {
        u32::from_ne_bytes([a[i * 4], a[i * 4 + 1], a[i * 4 + 2], a[i * 4 + 3]])
    };
    // The words as they lie in the pseudo-header, read in the machine's order (csum.rs).
    let mut sum = add16(
        u16::from_ne_bytes([0, IPPROTO_TCP]),
        u16::from_ne_bytes((len as u16).to_be_bytes()),
    );
    // An IPv4 address is the last word of its mapped form.
    let first = if p.v6 != 0 { 0 } else { 3 };
    for i in first..4 {
        sum = csum::add(sum, word(&p.saddr, i));
        sum = csum::add(sum, word(&p.daddr, i));
    }
    sum
}

#[inline(always)]
fn add16(a: u16, b: u16) -> u32 {
    a as u32 + b as u32
}
