//! A listing of the tree ([`super::scan`]), kept compact: the paths in a few large pieces of
//! text, a small fixed entry per path. A listing of 250,000 recordings is about 10 MB of text in
//! pieces of 1 MiB and 4 MB of entries, instead of a string of its own per path and a value per
//! path three times the size. The service's rescans and its start list the whole tree beside
//! the ingest; a listing of 272,000 recordings raised the service's resident memory by 58 MB
//! while it was made with a string per path, by 15 MB with this (docs/benchmarks.md, "The tree's
//! listing kept compact"). The text grows a piece at a time, so it is never copied to a larger
//! place, and listings of several folders are put together without copying their text.

use super::Found;
use crate::engine::outcome::Reason;

/// Entry of a path that is a recording.
const RECORDING: u32 = u32::MAX;

/// Bytes of each piece of text (a longer path has a piece of its own).
const PIECE: usize = 1 << 20;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Where the path is: piece, byte offset in it, length.
    piece: u32,
    start: u32,
    len: u32,
    /// [`RECORDING`], or the index of the reason the path is rejected.
    reason: u32,
}

/// Paths found in the tree with what each is, sorted by path once [`Listing::sort`] ran (every
/// listing [`super::scan`] returns is).
#[derive(Debug, Default, Clone)]
pub struct Listing {
    pieces: Vec<String>,
    entries: Vec<Entry>,
    reasons: Vec<Reason>,
    /// Folders that could not be listed (whole or in part), with why: what is below them is
    /// missing from the listing, not gone from the tree.
    unlisted: Vec<(String, String)>,
}

/// The text of an entry.
fn text<'a>(pieces: &'a [String], e: &Entry) -> &'a str {
    &pieces[e.piece as usize][e.start as usize..e.start as usize + e.len as usize]
}

/// A path of a listing, borrowed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Item<'a> {
    Recording(&'a str),
    Rejected { rel: &'a str, reason: &'a Reason },
}

impl<'a> Item<'a> {
    pub fn rel(&self) -> &'a str {
        match self {
            Item::Recording(rel) | Item::Rejected { rel, .. } => rel,
        }
    }

    pub fn to_found(self) -> Found {
        match self {
            Item::Recording(rel) => Found::Recording(rel.to_string()),
            Item::Rejected { rel, reason } => Found::Rejected {
                rel: rel.to_string(),
                reason: reason.clone(),
            },
        }
    }
}

impl Listing {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The relative path of entry `i`.
    pub fn rel(&self, i: usize) -> &str {
        text(&self.pieces, &self.entries[i])
    }

    /// Entry `i`.
    pub fn get(&self, i: usize) -> Item<'_> {
        let e = &self.entries[i];
        let rel = text(&self.pieces, e);
        match e.reason {
            RECORDING => Item::Recording(rel),
            r => Item::Rejected {
                rel,
                reason: &self.reasons[r as usize],
            },
        }
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = Item<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// The entries as [`Found`] values (a string each: for tests and small listings).
    pub fn to_vec(&self) -> Vec<Found> {
        self.iter().map(Item::to_found).collect()
    }

    /// The entry of `rel` in a sorted listing.
    pub fn find(&self, rel: &str) -> Option<usize> {
        self.entries
            .binary_search_by(|e| text(&self.pieces, e).cmp(rel))
            .ok()
    }

    fn push(&mut self, rel: &str, reason: u32) {
        let fits = self
            .pieces
            .last()
            .is_some_and(|p| p.capacity() - p.len() >= rel.len());
        if !fits {
            self.pieces
                .push(String::with_capacity(PIECE.max(rel.len())));
        }
        let piece = self.pieces.len() - 1;
        let text = &mut self.pieces[piece];
        // Pieces are 1 MiB unless a path is longer; none is near 4 GiB.
        let (start, len) = (text.len() as u32, rel.len() as u32);
        text.push_str(rel);
        self.entries.push(Entry {
            piece: u32::try_from(piece).expect("under 4 billion pieces"),
            start,
            len,
            reason,
        });
    }

    pub fn push_recording(&mut self, rel: &str) {
        self.push(rel, RECORDING);
    }

    /// Folders that could not be listed (relative, ending with `/`; the root is ""), with the
    /// error: their recordings are not in the listing, whether or not they are in the tree.
    pub fn unlisted(&self) -> &[(String, String)] {
        &self.unlisted
    }

    pub fn push_unlisted(&mut self, rel: &str, why: String) {
        self.unlisted.push((rel.to_string(), why));
    }

    pub fn push_rejected(&mut self, rel: &str, reason: Reason) {
        let r = u32::try_from(self.reasons.len()).expect("under 4 billion rejected paths");
        self.reasons.push(reason);
        self.push(rel, r);
    }

    /// Add the entries of `other` (unsorted: [`Listing::sort`] orders them). Its text is not
    /// copied.
    pub fn append(&mut self, other: Listing) {
        let (first_piece, first_reason) = (self.pieces.len() as u32, self.reasons.len() as u32);
        self.pieces.extend(other.pieces);
        self.reasons.extend(other.reasons);
        self.unlisted.extend(other.unlisted);
        self.entries.reserve_exact(other.entries.len());
        self.entries
            .extend(other.entries.into_iter().map(|e| Entry {
                piece: e.piece + first_piece,
                reason: match e.reason {
                    RECORDING => RECORDING,
                    r => r + first_reason,
                },
                ..e
            }));
    }

    /// Sort by path (a stable sort: runs already sorted are only merged).
    pub fn sort(&mut self) {
        let pieces = &self.pieces;
        self.entries
            .sort_by(|a, b| text(pieces, a).cmp(text(pieces, b)));
    }

    /// Keep only the entries whose path `keep` accepts (their text stays until the listing goes).
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let pieces = &self.pieces;
        self.entries.retain(|e| keep(text(pieces, e)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_keep_their_paths_and_reasons_through_append_and_sort() {
        let mut a = Listing::default();
        a.push_recording("LEAK/b.wav");
        a.push_rejected("LEAK/link.wav", Reason::SymbolicLink);
        let mut b = Listing::default();
        b.push_rejected("NORMAL/\u{fffd}.wav", Reason::NotUtf8);
        b.push_recording("A/a.wav");
        b.push_recording("NORMAL/z.wav");
        a.append(b);
        a.sort();
        assert_eq!(
            a.to_vec(),
            vec![
                Found::Recording("A/a.wav".into()),
                Found::Recording("LEAK/b.wav".into()),
                Found::Rejected {
                    rel: "LEAK/link.wav".into(),
                    reason: Reason::SymbolicLink
                },
                Found::Recording("NORMAL/z.wav".into()),
                Found::Rejected {
                    rel: "NORMAL/\u{fffd}.wav".into(),
                    reason: Reason::NotUtf8
                },
            ]
        );
        assert_eq!(a.find("LEAK/link.wav"), Some(2));
        assert_eq!(a.find("LEAK/c.wav"), None);
        assert_eq!(a.rel(3), "NORMAL/z.wav");
        assert_eq!(a.len(), 5);
    }

    /// Paths fill pieces of text one after another; a path longer than a piece has its own.
    #[test]
    fn paths_past_a_piece_and_longer_than_one_are_kept_whole() {
        let name = |i: usize| format!("LEAK/S{i:06}~R123~20250118120530~100.wav");
        let long = format!("LEAK/{}.wav", "d/".repeat(PIECE / 2 + 10));
        let mut l = Listing::default();
        let n = PIECE / name(0).len() * 2 + 7; // over two pieces' worth
        for i in (0..n).rev() {
            l.push_recording(&name(i));
            if i == n / 2 {
                l.push_recording(&long);
            }
        }
        l.sort();
        assert_eq!(l.len(), n + 1);
        assert!(l.pieces.len() >= 4, "{} pieces", l.pieces.len());
        let want: Vec<String> = (0..n).map(name).chain([long.clone()]).collect();
        let got: Vec<&str> = l.iter().map(|i| i.rel()).collect();
        assert_eq!(got, want);
        assert_eq!(l.find(&long), Some(n));
        assert_eq!(l.find(&name(n / 3)), Some(n / 3));
        let mut kept = l.clone();
        kept.retain(|rel| rel.len() < 100);
        assert_eq!(kept.len(), n);
        assert_eq!(kept.find(&long), None);
    }
}
