//! Internet checksums: incremental updates of the checksums in the packet (through the
//! kernel's helpers, which also keep skb->csum right for CHECKSUM_COMPLETE packets and leave
//! CHECKSUM_PARTIAL ones to the device), and the arithmetic for checksums the helpers cannot
//! reach (those inside the packet an ICMP error quotes), that are built from scratch, or that
//! are written together with the fields they cover (a translated IPv4 header's, `nat`: no
//! skb->csum to keep, as the header's own sum does not change).
//!
//! Values are ones'-complement sums of 16-bit words as they lie in memory, read in the
//! machine's order: the sum is independent of byte order as long as it is stored back the way
//! it was read, so no value here is ever byte-swapped.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::generated::{bpf_csum_diff, bpf_l3_csum_replace, bpf_l4_csum_replace},
    programs::TcContext,
};

/// The L4 checksum of an IPv6 packet (kernel 6.16+): a pseudo-header change must not be
/// applied to skb->csum, as IPv6 has no header checksum that absorbs it.
pub const BPF_F_IPV6: u64 = 1 << 7;

/// Folds a 32-bit partial sum into 16 bits (not complemented).
#[inline(always)]
pub fn fold(sum: u32) -> u16 {
    let s = (sum & 0xffff) + (sum >> 16);
    let s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// Ones'-complement addition of two partial sums.
#[inline(always)]
pub fn add(a: u32, b: u32) -> u32 {
    let (s, carry) = a.overflowing_add(b);
    s.wrapping_add(carry as u32)
}

/// The partial sum that turns a checksum over `from` into one over `to` (16-bit fields).
#[inline(always)]
pub fn diff16(from: u16, to: u16) -> u32 {
    add(!from as u32, to as u32)
}

/// The same for 32-bit fields.
#[inline(always)]
pub fn diff32(from: u32, to: u32) -> u32 {
    add(!from, to)
}

/// The same for an address (IPv4 mapped addresses differ in their last 4 bytes only).
#[inline(always)]
pub fn diff_addr(from: &[u8; 16], to: &[u8; 16]) -> u32 {
    let mut d = 0;
    for i in 0..4 {
        let f = u32::from_ne_bytes([
            from[i * 4],
            from[i * 4 + 1],
            from[i * 4 + 2],
            from[i * 4 + 3],
        ]);
        let t = u32::from_ne_bytes([to[i * 4], to[i * 4 + 1], to[i * 4 + 2], to[i * 4 + 3]]);
        d = add(d, diff32(f, t));
    }
    d
}

/// `check` (a checksum as stored) after the data it covers changed by `diff`, computed as
/// the kernel's helpers do (RFC 1624, eqn. 3), so both give the same bytes.
#[inline(always)]
pub fn apply(check: u16, diff: u32) -> u16 {
    !fold(add(diff, !(check as u32)))
}

/// The partial sum of `len` bytes at `buf` (`len` a multiple of 4), added to `seed`; the
/// helper does the work, so the length may vary. Negative: the helper refused.
///
/// # Safety
/// `buf` must point at `len` readable bytes the verifier knows.
#[inline(always)]
pub unsafe fn sum(buf: *const u8, len: u32, seed: u32) -> i64 {
    // SAFETY: as the caller promises; `from` is empty.
    unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, buf.cast_mut().cast(), len, seed) }
}

/// Flags for an L4 checksum update: UDP's "no checksum" (0, IPv4 only) stays 0 and a result
/// of 0 is written as 0xffff; for IPv6 the pseudo-header flag needs `BPF_F_IPV6`.
#[inline(always)]
pub fn l4_flags(proto: u8, v6: bool, pseudo: bool) -> u64 {
    let mut f = 0;
    if proto == svc_common::IPPROTO_UDP {
        f |= BPF_F_MARK_MANGLED_0 as u64;
    }
    if pseudo {
        f |= BPF_F_PSEUDO_HDR as u64;
        if v6 {
            f |= BPF_F_IPV6;
        }
    }
    f
}

/// Applies a change of `diff` to the L4 checksum at `off`.
#[inline(always)]
pub fn l4_diff(ctx: &TcContext, off: u32, diff: u32, flags: u64) -> bool {
    // SAFETY: the helper checks the offset; size 0 in the flags means `to` is a diff.
    unsafe { bpf_l4_csum_replace(ctx.skb.skb.cast(), off, 0, diff as u64, flags) == 0 }
}

/// Applies a change of a 2- or 4-byte field (`size`) to the L4 checksum at `off`.
#[inline(always)]
pub fn l4_replace(ctx: &TcContext, off: u32, from: u32, to: u32, size: u64, flags: u64) -> bool {
    // SAFETY: the helper checks the offset.
    unsafe {
        bpf_l4_csum_replace(
            ctx.skb.skb.cast(),
            off,
            from as u64,
            to as u64,
            flags | size,
        ) == 0
    }
}

/// Applies a change of a 2- or 4-byte field of the IPv4 header to its checksum at `off`.
#[inline(always)]
pub fn l3_replace(ctx: &TcContext, off: u32, from: u32, to: u32, size: u64) -> bool {
    // SAFETY: the helper checks the offset.
    unsafe { bpf_l3_csum_replace(ctx.skb.skb.cast(), off, from as u64, to as u64, size) == 0 }
}
