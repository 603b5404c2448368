// Native core of specdec's suffix drafter (specdec.drafters._suffix_native).
//
// Same algorithm as the pure-Python reference engine in drafters/suffix_ref.py (tests check that both
// produce identical drafts). A bounded-depth suffix trie counts every substring of length <= depth:
//   count[node] = occurrences of the node's token path; total[node] = sum of its children's counts
//   (so P(child | node) = count[child] / total[node] ignores occurrences without a continuation,
//   such as the current end of the context itself).
// One trie per active request (prompt + output so far) and one global trie over finished responses
// (FIFO eviction by cached requests / cached tokens). Appending a token costs O(depth) hash lookups via
// the request's frontier (the nodes of its last `depth - 1` suffixes); no per-step rebuild.
// Plain CPython C API, no third-party build dependency.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int32_t NIL = -1;
constexpr uint64_t EMPTY_KEY = ~0ull;

inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

inline uint64_t edge_key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
}

// Open-addressing (linear probing, backward-shift deletion) map: (parent, token) -> child node.
// Growing is incremental: at half load a table of twice the size takes over and every insert moves
// MIGRATE_SLOTS slots of the old table into it, so no single call rehashes the whole map (a one-shot rehash
// of a large global trie stalled a drafting step for tens of milliseconds). While the old table is being
// drained, lookups try the new table first, then the old one; keys erased from the old table leave a
// tombstone (nothing is inserted there any more, and moving stops at tombstones).
class EdgeMap {
public:
    EdgeMap() { reset(16); }

    int32_t find(uint64_t key) const {
        int32_t v = probe(keys_, mask_, vals_, key);
        if (v != NIL || old_keys_.empty()) return v;
        return probe(old_keys_, old_mask_, old_vals_, key);
    }

    // `key` must be absent (callers look it up first).
    void insert(uint64_t key, int32_t val) {
        if (!old_keys_.empty()) migrate(MIGRATE_SLOTS);
        else if ((size_ + 1) * 2 > keys_.size()) start_growing();
        put(key, val);
        ++size_;
    }

    void erase(uint64_t key) {
        bool found = erase_main(key);
        if (!old_keys_.empty()) found = tomb_old(key) || found;  // a moved key's old copy must go too
        if (found) --size_;
    }

    // An empty map sized for `n` keys at once (no growth while they go in); otherwise a no-op.
    void reserve(size_t n) {
        if (size_ != 0 || !old_keys_.empty()) return;
        size_t cap = keys_.size();
        while (cap < 2 * n + 2) cap *= 2;
        if (cap != keys_.size()) reset(cap);
    }

    size_t memory_bytes() const {
        return (keys_.capacity() + old_keys_.capacity()) * sizeof(uint64_t) +
               (vals_.capacity() + old_vals_.capacity()) * sizeof(int32_t);
    }

private:
    static constexpr uint64_t TOMB_KEY = ~0ull - 1;  // never a real key: parents are >= 0 int32
    static constexpr size_t MIGRATE_SLOTS = 8;  // old slots moved per insert: drained within old_size / 8 inserts
    std::vector<uint64_t> keys_, old_keys_;
    std::vector<int32_t> vals_, old_vals_;
    size_t mask_ = 0, old_mask_ = 0, size_ = 0, moved_ = 0;  // size_: distinct keys in both tables

    static int32_t probe(const std::vector<uint64_t>& keys, size_t mask, const std::vector<int32_t>& vals,
                         uint64_t key) {
        size_t i = mix64(key) & mask;
        while (true) {
            uint64_t k = keys[i];
            if (k == key) return vals[i];
            if (k == EMPTY_KEY) return NIL;
            i = (i + 1) & mask;
        }
    }

    void put(uint64_t key, int32_t val) {
        size_t i = mix64(key) & mask_;
        while (keys_[i] != EMPTY_KEY) i = (i + 1) & mask_;
        keys_[i] = key;
        vals_[i] = val;
    }

    bool erase_main(uint64_t key) {
        size_t i = mix64(key) & mask_;
        while (keys_[i] != key) {
            if (keys_[i] == EMPTY_KEY) return false;
            i = (i + 1) & mask_;
        }
        size_t j = i;
        while (true) {
            j = (j + 1) & mask_;
            if (keys_[j] == EMPTY_KEY) break;
            size_t home = mix64(keys_[j]) & mask_;
            bool move = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
            if (move) {
                keys_[i] = keys_[j];
                vals_[i] = vals_[j];
                i = j;
            }
        }
        keys_[i] = EMPTY_KEY;
        return true;
    }

    bool tomb_old(uint64_t key) {
        size_t i = mix64(key) & old_mask_;
        while (old_keys_[i] != key) {
            if (old_keys_[i] == EMPTY_KEY) return false;
            i = (i + 1) & old_mask_;
        }
        old_keys_[i] = TOMB_KEY;
        return true;
    }

    void reset(size_t cap) {
        keys_.assign(cap, EMPTY_KEY);
        vals_.assign(cap, NIL);
        mask_ = cap - 1;
    }

    void start_growing() {
        old_keys_.swap(keys_);
        old_vals_.swap(vals_);
        old_mask_ = mask_;
        moved_ = 0;
        reset(old_keys_.size() * 2);
    }

    void migrate(size_t slots) {
        size_t end = std::min(moved_ + slots, old_keys_.size());
        for (; moved_ < end; ++moved_) {
            uint64_t k = old_keys_[moved_];
            if (k != EMPTY_KEY && k != TOMB_KEY) put(k, old_vals_[moved_]);
        }
        if (moved_ == old_keys_.size()) {  // drained: drop the old table
            std::vector<uint64_t>().swap(old_keys_);
            std::vector<int32_t>().swap(old_vals_);
        }
    }
};

// Fixed-size pages of T: growing never moves existing elements (a vector's doubling copied every node of a
// large trie at once), and references stay valid.
template <typename T>
class PagedVector {
public:
    static constexpr size_t PAGE_BITS = 11;  // 2,048 nodes (~90 KB): small tries stay small
    static constexpr size_t PAGE = size_t(1) << PAGE_BITS;

    T& operator[](size_t i) { return pages_[i >> PAGE_BITS][i & (PAGE - 1)]; }
    const T& operator[](size_t i) const { return pages_[i >> PAGE_BITS][i & (PAGE - 1)]; }
    size_t size() const { return size_; }
    size_t capacity() const { return pages_.size() * PAGE; }
    void push_back(const T& value) {
        if (size_ == capacity()) pages_.emplace_back(new T[PAGE]);
        (*this)[size_++] = value;
    }

private:
    std::vector<std::unique_ptr<T[]>> pages_;
    size_t size_ = 0;
};

// A node is explicit (its children are stored) or an implicit leaf: a substring that occurs exactly once,
// standing for the whole chain of count-1 nodes below it, read from its occurrence in a stored sequence
// (ref_seq, ref_pos = position of the node's own token). Counts and drafts equal those of the plain trie
// (the Python reference), but only repeated substrings cost nodes, and appending a token touches only the
// suffixes that occurred before (O(match length) <= O(depth)).
struct Node {
    int32_t token, count, total, best, first, next, prev, parent;
    int32_t depth;    // root 0
    int32_t ref_seq;  // >= 0: implicit leaf
    int32_t ref_pos;
};

constexpr Node BLANK{NIL, 0, 0, NIL, NIL, NIL, NIL, NIL, 0, -1, -1};

// A position in the trie: an explicit node (off 0) or `off` tokens below a leaf's head.
struct Cursor {
    int32_t node, off;
};

class Trie {
public:
    explicit Trie(int depth) : depth_(depth) { nodes_.push_back(BLANK); }

    int depth() const { return depth_; }
    void reserve_edges(size_t n) { map_.reserve(n); }
    const Node& node(int32_t i) const { return nodes_[i]; }
    int32_t child(int32_t n, int32_t tok) const { return map_.find(edge_key(n, tok)); }
    size_t live_nodes() const { return nodes_.size() - free_.size(); }
    std::vector<int32_t>& seq(int32_t id) { return seqs_[id]; }
    const std::vector<int32_t>& seq(int32_t id) const { return seqs_.at(id); }
    bool is_leaf(int32_t n) const { return nodes_[n].ref_seq >= 0; }

    size_t memory_bytes() const {
        size_t total = sizeof(*this) + nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(int32_t) +
                       map_.memory_bytes();
        for (const auto& kv : seqs_) total += kv.second.capacity() * sizeof(int32_t) + 32;
        return total;
    }

    // Continuation of a cursor: (token, prob, next cursor) for leaves; false when there is none.
    bool leaf_next(const Cursor& c, int32_t& tok, Cursor& next) const {
        const Node& nd = nodes_[c.node];
        if (nd.depth + c.off + 1 > depth_) return false;
        const std::vector<int32_t>& s = seq(nd.ref_seq);
        size_t pos = static_cast<size_t>(nd.ref_pos) + c.off + 1;
        if (pos >= s.size()) return false;
        tok = s[pos];
        next = Cursor{c.node, c.off + 1};
        return true;
    }

    bool has_continuation(const Cursor& c) const {
        if (!is_leaf(c.node)) return nodes_[c.node].total > 0;
        int32_t tok;
        Cursor next;
        return leaf_next(c, tok, next);
    }

    // Sequence `sid` got its token at `pos`; `front` = explicit nodes of its previous suffixes (front[0] = root).
    void append(std::vector<int32_t>& front, int32_t sid, size_t pos) {
        int32_t tok = seqs_[sid][pos];
        size_t n = front.size();
        size_t cap = std::min<size_t>(n + 1, static_cast<size_t>(depth_));
        front.resize(cap);
        size_t keep = 1;
        for (size_t m = n; m-- > 0;) {
            int32_t parent = front[m];
            int32_t c = child(parent, tok);
            if (c == NIL) {
                new_node(parent, tok, sid, static_cast<int32_t>(pos));
                continue;
            }
            if (is_leaf(c)) materialize(c);
            bump(parent, c);
            if (m + 1 < cap) {
                front[m + 1] = c;
                keep = std::max(keep, m + 2);
            }
        }
        front.resize(keep);
        front[0] = 0;
    }

    int32_t add_sequence(std::vector<int32_t>&& tokens) {
        int32_t id = next_seq_++;
        seqs_[id] = std::move(tokens);
        std::vector<int32_t> front{0};
        size_t n = seqs_[id].size();
        for (size_t i = 0; i < n; ++i) append(front, id, i);
        return id;
    }

    // Remove every substring occurrence of sequence `id` (deepest node first), then the sequence.
    void remove_sequence(int32_t id) {
        const std::vector<int32_t> s = seqs_[id];
        std::vector<int32_t> path;
        for (size_t start = 0; start < s.size(); ++start) {
            path.clear();
            int32_t cur = 0;
            size_t end = std::min(s.size(), start + static_cast<size_t>(depth_));
            for (size_t i = start; i < end; ++i) {
                cur = child(cur, s[i]);
                if (cur == NIL) break;  // cannot happen for an inserted sequence
                path.push_back(cur);
                if (is_leaf(cur)) break;
            }
            for (size_t k = path.size(); k-- > 0;) decrement(path[k]);
        }
        seqs_.erase(id);
    }

    // Read-only match frontier: cursors of the suffixes (lengths 0..) that occur, extended by `tok`.
    void step_match(std::vector<Cursor>& front, int32_t tok, std::vector<Cursor>& tmp) const {
        tmp.clear();
        tmp.push_back(Cursor{0, 0});
        for (size_t m = 0; m < front.size() && m + 1 < static_cast<size_t>(depth_); ++m) {
            const Cursor& c = front[m];
            if (is_leaf(c.node)) {
                int32_t t;
                Cursor next;
                if (!leaf_next(c, t, next) || t != tok) break;
                tmp.push_back(next);
            } else {
                int32_t ch = child(c.node, tok);
                if (ch == NIL) break;
                tmp.push_back(Cursor{ch, 0});
            }
        }
        front.swap(tmp);
    }

private:
    int depth_;
    PagedVector<Node> nodes_;
    std::vector<int32_t> free_;
    EdgeMap map_;
    std::unordered_map<int32_t, std::vector<int32_t>> seqs_;
    int32_t next_seq_ = 1;  // 0 is left to the owner (a request's own context)

    // A new child leaf with count 1 (a first occurrence), newest first in the parent's list.
    int32_t new_node(int32_t n, int32_t tok, int32_t sid, int32_t pos) {
        int32_t c;
        if (!free_.empty()) {
            c = free_.back();
            free_.pop_back();
        } else {
            c = static_cast<int32_t>(nodes_.size());
            nodes_.push_back(BLANK);
        }
        int32_t head = nodes_[n].first;
        nodes_[c] = Node{tok, 0, 0, NIL, NIL, head, NIL, n, nodes_[n].depth + 1, sid, pos};
        if (head != NIL) nodes_[head].prev = c;
        nodes_[n].first = c;
        map_.insert(edge_key(n, tok), c);
        bump(n, c);
        return c;
    }

    // Turn a leaf into an explicit node (count unchanged) whose one child continues its occurrence.
    void materialize(int32_t c) {
        int32_t sid = nodes_[c].ref_seq;
        int32_t pos = nodes_[c].ref_pos + 1;
        nodes_[c].ref_seq = -1;
        nodes_[c].ref_pos = -1;
        if (nodes_[c].depth + 1 > depth_) return;
        const std::vector<int32_t>& s = seqs_[sid];
        if (static_cast<size_t>(pos) >= s.size()) return;
        new_node(c, s[pos], sid, pos);
    }

    void bump(int32_t n, int32_t c) {
        Node& child_node = nodes_[c];
        child_node.count += 1;
        Node& parent = nodes_[n];
        parent.total += 1;
        // Ties go to the most recently counted child (recency breaks frequency ties).
        if (parent.best == NIL || child_node.count >= nodes_[parent.best].count) parent.best = c;
    }

    void decrement(int32_t c) {
        int32_t n = nodes_[c].parent;
        nodes_[c].count -= 1;
        nodes_[n].total -= 1;
        if (nodes_[c].count == 0) unlink(c);
        if (nodes_[n].best == c || nodes_[n].best == NIL) rescan_best(n);
    }

    void unlink(int32_t c) {
        Node& x = nodes_[c];
        if (x.prev != NIL) nodes_[x.prev].next = x.next; else nodes_[x.parent].first = x.next;
        if (x.next != NIL) nodes_[x.next].prev = x.prev;
        map_.erase(edge_key(x.parent, x.token));
        if (nodes_[x.parent].best == c) nodes_[x.parent].best = NIL;
        x = BLANK;
        free_.push_back(c);
    }

    void rescan_best(int32_t n) {
        int32_t best = NIL;
        for (int32_t c = nodes_[n].first; c != NIL; c = nodes_[c].next)
            if (best == NIL || nodes_[c].count > nodes_[best].count) best = c;
        nodes_[n].best = best;
    }
};

#include "suffix_calib.inc"  // Calibration: calibrated chain probabilities

struct DraftParams {
    int budget;
    bool tree;
    double factor, offset, min_prob;
    double leaf_prior = 0.0;  // > 0: a continuation seen once gets (l + 1) / (l + 1 + leaf_prior), l = its match length
    const Calibration* calib = nullptr;  // chains: calibrated P(next token) instead of count / total (see Calibration)
};

// P(next token | its path) from `count` of `total` occurrences. With `leaf_prior` > 0 a continuation seen only once
// (a leaf, or a node of total 1) is not certain: Laplace's rule of succession over the `ell` tokens the context has
// matched so far (the trie match plus the draft before it), (ell + 1) / (ell + 1 + leaf_prior). A long copy keeps
// going, a short coincidental match fades after a few tokens (leaf_prior 1: a chain's path is (m + 1) / (m + n + 1)).
inline double cont_prob(int32_t count, int32_t total, int ell, double leaf_prior) {
    if (total == 1 && leaf_prior > 0) return (ell + 1.0) / (ell + 1.0 + leaf_prior);
    return static_cast<double>(count) / static_cast<double>(total);
}

struct Draft {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;  // P(node | parent path)
    double score = 0.0;
    int match_len = 0;
    int source = -1;  // 0 local, 1 global
    void clear() {
        tokens.clear();
        parents.clear();
        probs.clear();
        score = 0.0;
        match_len = 0;
        source = -1;
    }
};

struct HeapItem {
    double path;
    double prob;
    int64_t seq;
    int32_t token;
    Cursor cur;
    int32_t parent, depth;
    bool operator<(const HeapItem& o) const {  // max-heap on path prob, FIFO among ties
        if (path != o.path) return path < o.path;
        return seq > o.seq;
    }
};

// The most frequent continuation of `c`: its token, count, its node's total and the cursor after it; false when
// nothing follows (a leaf continues its one occurrence: count = total = 1).
bool top_child(const Trie& t, const Cursor& c, int32_t& tok, int32_t& count, int32_t& total, Cursor& next) {
    if (t.is_leaf(c.node)) {
        count = total = 1;
        return t.leaf_next(c, tok, next);
    }
    const Node& nd = t.node(c.node);
    if (nd.total <= 0 || nd.best == NIL) return false;
    const Node& b = t.node(nd.best);
    tok = b.token;
    count = b.count;
    total = nd.total;
    next = Cursor{nd.best, 0};
    return true;
}

// Most likely next step from `c` in trie `src`: (token, P(token | c), next cursor); false when nothing follows.
// `ell`: tokens matched before it (see cont_prob and Calibration).
bool best_step(const Trie& t, const Cursor& c, int ell, const DraftParams& p, int src, int32_t& tok, double& q,
               Cursor& next) {
    int32_t count, total;
    if (!top_child(t, c, tok, count, total, next)) return false;
    q = p.calib ? p.calib->prob(src, ell, count, total) : cont_prob(count, total, ell, p.leaf_prior);
    return true;
}

void draft_chain(const Trie& t, Cursor cur, int m, int max_len, const DraftParams& p, int src, Draft& out) {
    double path = 1.0, min_prob = p.min_prob;
    int limit = std::min(max_len, p.budget);
    int32_t tok;
    double q;
    Cursor next;
    while (static_cast<int>(out.tokens.size()) < limit &&
           best_step(t, cur, m + static_cast<int>(out.tokens.size()), p, src, tok, q, next)) {
        if (path * q < min_prob) break;
        path *= q;
        out.parents.push_back(static_cast<int32_t>(out.tokens.size()) - 1);
        out.tokens.push_back(tok);
        out.probs.push_back(q);
        out.score += path;
        cur = next;
    }
}

// Children of `c` (at `depth`, 1-based, below a match of `m` tokens) onto the heap.
void push_children(const Trie& t, const Cursor& c, double path, int32_t parent, int32_t depth, int m,
                   const DraftParams& p, int64_t& seq, std::priority_queue<HeapItem>& heap) {
    const double min_prob = p.min_prob;
    const int ell = m + depth - 1;
    if (t.is_leaf(c.node)) {
        int32_t tok;
        Cursor next;
        double q = cont_prob(1, 1, ell, p.leaf_prior);
        if (t.leaf_next(c, tok, next) && path * q >= min_prob)
            heap.push(HeapItem{path * q, q, seq++, tok, next, parent, depth});
        return;
    }
    const Node& nd = t.node(c.node);
    if (nd.total <= 0) return;
    for (int32_t ch = nd.first; ch != NIL; ch = t.node(ch).next) {
        double q = cont_prob(t.node(ch).count, nd.total, ell, p.leaf_prior);
        double child_path = path * q;
        if (child_path >= min_prob)
            heap.push(HeapItem{child_path, q, seq++, t.node(ch).token, Cursor{ch, 0}, parent, depth});
    }
}

void draft_tree(const Trie& t, const Cursor& start, int m, int max_depth, const DraftParams& p, Draft& out) {
    std::priority_queue<HeapItem> heap;
    int64_t seq = 0;
    if (max_depth < 1) return;
    push_children(t, start, 1.0, -1, 1, m, p, seq, heap);
    while (!heap.empty() && static_cast<int>(out.tokens.size()) < p.budget) {
        HeapItem it = heap.top();
        heap.pop();
        int32_t idx = static_cast<int32_t>(out.tokens.size());
        out.tokens.push_back(it.token);
        out.parents.push_back(it.parent);
        out.probs.push_back(it.prob);
        out.score += it.path;
        if (it.depth < max_depth) push_children(t, it.cur, it.path, idx, it.depth + 1, m, p, seq, heap);
    }
}

int length_cap(int m, const DraftParams& p) {
    double cap = std::floor(m * p.factor + p.offset + 1e-9);
    if (cap < 0) return 0;
    return cap > 1e9 ? 1000000000 : static_cast<int>(cap);
}

// Occurrences of a match that have a continuation (a leaf cursor: 1 or 0).
int32_t continued(const Trie& t, const Cursor& c) {
    if (!t.is_leaf(c.node)) return t.node(c.node).total;
    return t.has_continuation(c) ? 1 : 0;
}

// The match of length m has the continuations of the one of length m + 1 (as many occurrences with a continuation,
// so the same ones), and that one's chain has room for all it may draft below the trie's depth.
bool same_as_longer(const Trie& t, const std::vector<Cursor>& front, size_t m, const DraftParams& p) {
    int longer = static_cast<int>(m) + 1;
    int room = t.depth() - longer;
    return room >= std::min(p.budget, length_cap(longer, p)) && continued(t, front[m]) == continued(t, front[m + 1]);
}

constexpr double BOUND_SLACK = 1e-9;  // rounding margin of the score bound below (it must never skip a winner)

// Best draft over all match lengths of `front` in trie `t` (longest first; strictly better replaces).
// Bounds on a draft's score (sum of its nodes' path probabilities): <= its number of levels (the nodes of one
// depth are disjoint continuations, their paths sum to <= 1), and every node's path is <= q1, the probability of
// the most likely first token, so a chain scores <= levels x q1 and a tree <= nodes x q1. Match lengths whose bound
// cannot beat the best so far are skipped without walking their chain or tree (same result, less work).
// Calibrated chains also skip a match whose continuations are those of the next longer one (same number of
// occurrences with a continuation: the same occurrences) when that one's chain cannot reach the trie's depth: its
// chain is the longer one's, with one token less matched at every step (see same_as_longer).
void best_draft(const Trie& t, const std::vector<Cursor>& front, const DraftParams& p, int source, Draft& best,
                Draft& tmp) {
    for (size_t m = front.size(); m-- > 1;) {
        int cap = length_cap(static_cast<int>(m), p);
        double bound = std::min(static_cast<double>(p.budget), static_cast<double>(cap));
        if (bound <= best.score) break;
        if (p.calib && m + 1 < front.size() && same_as_longer(t, front, m, p)) continue;
        int32_t tok;
        double q1;
        Cursor next;
        if (!best_step(t, front[m], static_cast<int>(m), p, source, tok, q1, next)) continue;  // nothing follows
        double reach = p.tree ? std::min(bound, p.budget * q1) : bound * q1;
        if (reach + BOUND_SLACK <= best.score) continue;
        tmp.clear();
        if (p.tree) draft_tree(t, front[m], static_cast<int>(m), cap, p, tmp);
        else draft_chain(t, front[m], static_cast<int>(m), cap, p, source, tmp);
        if (tmp.score > best.score) {
            std::swap(best, tmp);
            best.match_len = static_cast<int>(m);
            best.source = source;
        }
    }
}

constexpr int32_t LOCAL_SEQ = 0;
constexpr size_t LOCAL_EDGES_PER_TOKEN = 3;  // a prompt's local trie: ~3 edges per token (OpenHands, depth 64)

// The vLLM proposer's per-request bookkeeping, kept here for the one-call step (suffix_lane.inc);
// mirrors specdec/vllm_plugin/core.py::RequestState.
struct Book {
    int64_t n_known = 0;      // context length the drafter has seen
    int32_t last_draft = 0;   // tokens submitted at the previous step (padding included)
    int32_t last_real = 0;    // of which the drafter's own (before padding)
    double last_pred = NAN;   // sum of their path probabilities (NaN: none)
    double pred_ema = 0.0, acc_ema = 0.0;  // calibration sums
    bool fresh = false;       // just (re)started with n_known already counting this step's tokens

    void clear_draft() {      // no draft this step
        last_draft = last_real = 0;
        last_pred = NAN;
    }
};

// Constants of the one-call step, set once by lane_config (one source of truth: the Python side).
struct LaneConfig {
    bool configured = false;
    double calib_decay = 0.8;       // decay of the calibration sums
    double min_calib_mass = 3.0, min_calib = 0.05, max_calib = 1.5;
    double max_cut = 0.9;           // the confidence threshold never exceeds this
    double factor = 8.0, offset = 0.0, min_prob = 0.1, leaf_prior = 0.0;  // draft parameters (SuffixConfig)
    double pad_factor = 8.0;  // the factor of padded steps (verification free: SuffixConfig.free_spec_factor)
    double min_confidence = 0.0;  // > 0: calibrated chains (Calibration), cut below it instead of min_prob
    bool use_local = true, use_global = true;

    bool calibrated() const { return min_confidence > 0; }
};

struct LaneStep {  // one lane call's per-step decisions
    int k = 0;
    long long max_model_len = 0;
    bool spec = false, pad = false, adaptive = false;
    double floor = 0, value = 0;
};

// One vLLM step handed to the lane thread (lane_submit), and its result (lane_collect): see suffix_lane_async.inc.
struct LaneRow {
    int64_t rid;          // engine request id (-1: none)
    int64_t n;            // context length after the new tokens
    uint32_t begin, end;  // its new tokens in LaneJob::tokens
    int32_t restart;      // index in LaneJob::restarts, or -1
};

struct LaneRestart {
    int64_t rid;
    size_t prompt;                // prompt length within ctx
    std::vector<int32_t> ctx;     // the row's whole context (from vLLM's token buffer)
    bool resync;                  // the request was known (a resync: its old state is stopped first)
};

struct LaneJob {
    LaneStep s;
    std::vector<int64_t> stops;   // requests absent from the batch, stopped first
    std::vector<LaneRow> rows;
    std::vector<int32_t> tokens;  // every row's new tokens, back to back
    std::vector<LaneRestart> restarts;
    std::vector<int32_t> out;     // drafts, back to back
    std::vector<uint32_t> out_end;  // per row: end of its draft in `out`
    long long accepted = 0, drafted = 0, carried = 0;  // carried: accepted of a job never collected
    std::string error;            // what the job threw (reported by lane_collect)
    Clock::time_point t_launch, t_start, t_end;  // submitted, started on the lane thread, finished
    bool pending = false;         // submitted and not collected
};

struct LanePrep {  // lane_prepare: stops and starts known when vLLM schedules a step, run while it executes
    std::vector<int64_t> stops;
    std::vector<std::pair<int64_t, std::vector<int32_t>>> starts;  // (engine id, prompt)
    std::string error;
};

struct Request {
    Book book;
    std::unique_ptr<Trie> local;       // its sequence LOCAL_SEQ is the context (prompt + output so far)
    size_t prompt_len = 0;
    std::vector<int32_t> local_front;  // explicit nodes of the context's repeated suffixes
    std::vector<Cursor> local_cursors;
    std::vector<Cursor> global_front;  // match frontier in the global trie
    uint64_t global_version = ~0ull;
};

constexpr size_t CACHE_LINES = 128;  // alignment of per-worker data: no two workers write one cache-line pair

// Per-thread working memory of matching and drafting (the engine's own, or one per lane worker).
struct alignas(CACHE_LINES) Scratch {
    std::vector<Cursor> front;
    Draft best, tmp;
    Calibration learned;  // a lane worker's observations of one step, absorbed into Engine::calib after its extends
};

// A per-worker count of a lane job.
struct alignas(CACHE_LINES) WorkerCount {
    long long value = 0;
};

// One row's draft of a lane job, written by whichever worker drafts the row.
struct alignas(CACHE_LINES) RowChain {
    std::vector<int32_t> tokens;
};

// Token ids outside [0, 2^31) (another vocabulary's, or synthetic ones) do not fit the tries' int32 tokens: each
// distinct one gets a negative code (-2, -3, ...) on the way in (start / extend) and its id back on the way out
// (draft). Tokens are only compared for equality in the tries, so drafts are those of 64-bit storage; ids in
// [0, 2^31) (every real vocabulary, vLLM's lane steps) pass through unchanged. Negative ids are refused.
struct WideIds {
    static constexpr int32_t FIRST_CODE = -2;  // -1 is never a token code (it marks padding in lane token rows)
    std::unordered_map<int64_t, int32_t> code;
    std::vector<int64_t> id;  // id[k] has code FIRST_CODE - k

    // false when the table is full (2^31 - 2 distinct wide ids)
    bool encode(int64_t v, int32_t& out) {
        auto it = code.find(v);
        if (it != code.end()) {
            out = it->second;
            return true;
        }
        if (id.size() >= static_cast<size_t>(INT32_MAX) - 1) return false;
        out = FIRST_CODE - static_cast<int32_t>(id.size());
        code.emplace(v, out);
        id.push_back(v);
        return true;
    }
    int64_t decode(int32_t c) const { return c >= 0 ? c : id[static_cast<size_t>(FIRST_CODE - c)]; }
};

struct Engine;

#include "job_thread.inc"  // JobThread: the lane thread
#include "worker_pool.inc"  // WorkerPool: helpers of the lane thread

struct Engine {
    int depth;
    int64_t max_requests, max_tokens;
    Trie global;
    WideIds wide;  // codes of token ids >= 2^31 (main thread only: start / extend / draft)
    uint64_t version = 0;
    std::deque<std::pair<int32_t, int64_t>> cached;  // (sequence id in the global trie, tokens)
    int64_t cached_tokens = 0;
    std::unordered_map<int64_t, Request> requests;
    Scratch scratch;                 // the calling thread's (lane workers have their own: `lane_scratch`)
    std::vector<Scratch> lane_scratch;  // per lane worker
    std::vector<Request*> lane_rows;    // the lane job's requests by row
    std::vector<RowChain> lane_chains;  // the lane job's drafts by row
    LaneConfig lane;
    LaneJob job;                   // the asynchronous lane step (suffix_lane_async.inc)
    LanePrep prep;                 // the step's early stops and starts (lane_prepare)
    WorkerPool workers;            // the lane thread's helpers (destroyed after the lane thread is joined)
    JobThread lane_thread;         // declared last: destroyed (joined) first; runs `job`

    Calibration calib;             // learned by extend_learning (the library's extend, the calibrated lane's rows),
                                   // read by calibrated drafts

    Engine(int d, int64_t mr, int64_t mt) : depth(d), max_requests(mr), max_tokens(mt), global(d) {}

    // Rows of one lane step may extend and draft on several threads at once: each touches its own request and
    // its thread's scratch, and only reads the global trie (stops, starts and caching happen between such runs).
    void refresh_global(Request& r, Scratch& s) {
        if (r.global_version == version) return;
        r.global_front.assign(1, Cursor{0, 0});
        const std::vector<int32_t>& ctx = r.local->seq(LOCAL_SEQ);
        size_t n = ctx.size();
        size_t from = n > static_cast<size_t>(depth) ? n - depth : 0;
        for (size_t i = from; i < n; ++i) global.step_match(r.global_front, ctx[i], s.front);
        r.global_version = version;
    }

    void start(int64_t rid, const int32_t* toks, size_t n) {
        Request& r = requests[rid];
        r.local = std::make_unique<Trie>(depth);
        r.local->reserve_edges(n * LOCAL_EDGES_PER_TOKEN);  // the prompt's edges go in without table growth
        std::vector<int32_t>& ctx = r.local->seq(LOCAL_SEQ);
        ctx.assign(toks, toks + n);
        r.prompt_len = n;
        r.local_front.assign(1, 0);
        for (size_t i = 0; i < n; ++i) r.local->append(r.local_front, LOCAL_SEQ, i);
        r.global_version = ~0ull;
        refresh_global(r, scratch);
    }

    void extend(Request& r, const int32_t* toks, size_t n) { extend(r, toks, n, scratch); }

    // The library's extend (main thread only): before each token, the calibration learns whether each trie's top
    // continuation of its longest match was that token; then the token is appended.
    void extend_learning(Request& r, const int32_t* toks, size_t n) { extend_learning(r, toks, n, scratch, calib); }

    // The same, observations into `into` (a lane worker's own table, absorbed into `calib` after the step's extends)
    // with scratch `s`: several rows' requests at once, each on its own thread (see refresh_global).
    void extend_learning(Request& r, const int32_t* toks, size_t n, Scratch& s, Calibration& into) {
        refresh_global(r, s);
        for (size_t i = 0; i < n; ++i) {
            observe(r, toks[i], into);
            extend(r, toks + i, 1, s);
        }
    }

    void observe(const Request& r, int32_t tok, Calibration& into) const {
        int32_t t, count, total;
        Cursor next;
        for (size_t m = r.local_front.size(); m-- > 1;) {
            if (top_child(*r.local, Cursor{r.local_front[m], 0}, t, count, total, next)) {
                into.observe(0, static_cast<int>(m), count, total, t == tok);
                break;
            }
        }
        for (size_t m = r.global_front.size(); m-- > 1;) {
            if (top_child(global, r.global_front[m], t, count, total, next)) {
                into.observe(1, static_cast<int>(m), count, total, t == tok);
                break;
            }
        }
    }

    void extend(Request& r, const int32_t* toks, size_t n, Scratch& s) {
        bool fresh = r.global_version == version;
        std::vector<int32_t>& ctx = r.local->seq(LOCAL_SEQ);
        for (size_t i = 0; i < n; ++i) {
            ctx.push_back(toks[i]);
            r.local->append(r.local_front, LOCAL_SEQ, ctx.size() - 1);
            if (fresh) global.step_match(r.global_front, toks[i], s.front);
        }
    }

    void stop(int64_t rid) {
        auto it = requests.find(rid);
        if (it == requests.end()) return;
        cache_response(it->second);
        requests.erase(it);
    }

    void cache_response(Request& r) {
        const std::vector<int32_t>& ctx = r.local->seq(LOCAL_SEQ);
        if (ctx.size() > r.prompt_len) cache(std::vector<int32_t>(ctx.begin() + r.prompt_len, ctx.end()));
    }

    // A finished response into the global trie (a stopped request's, or one from elsewhere), oldest evicted first.
    void cache(std::vector<int32_t>&& resp) {
        if (max_requests > 0 && max_tokens > 0 && !resp.empty()) {
            int64_t len = static_cast<int64_t>(resp.size());
            int32_t id = global.add_sequence(std::move(resp));
            cached_tokens += len;
            cached.emplace_back(id, len);
            evict();
            ++version;
        }
    }

    void evict() {
        while (!cached.empty() && (static_cast<int64_t>(cached.size()) > max_requests || cached_tokens > max_tokens)) {
            global.remove_sequence(cached.front().first);
            cached_tokens -= cached.front().second;
            cached.pop_front();
            ++version;
        }
    }

    const Draft& draft(Request& r, const DraftParams& p, bool use_local, bool use_global) {
        return draft(r, p, use_local, use_global, scratch);
    }

    const Draft& draft(Request& r, const DraftParams& p, bool use_local, bool use_global, Scratch& s) {
        s.best.clear();
        if (p.budget <= 0) return s.best;
        if (use_local) {
            r.local_cursors.resize(r.local_front.size());
            for (size_t i = 0; i < r.local_front.size(); ++i) r.local_cursors[i] = Cursor{r.local_front[i], 0};
            best_draft(*r.local, r.local_cursors, p, 0, s.best, s.tmp);
        }
        if (use_global) {
            refresh_global(r, s);
            best_draft(global, r.global_front, p, 1, s.best, s.tmp);
        }
        return s.best;
    }

    size_t memory_bytes() const {
        size_t total = global.memory_bytes();
        for (const auto& kv : requests) total += kv.second.local->memory_bytes();
        return total;
    }
};

// ------------------------------------------------------------------------------------- Python glue
struct PyEngine {
    PyObject_HEAD
    Engine* engine;
};

// Every entry point first waits (GIL released) for an asynchronous lane step still running and settles one that
// was never collected (suffix_lane_async.inc): only one thread drives the engine at a time.
void quiesce(Engine& e);

// Token values from an int32 / int64 C-contiguous buffer or a sequence of Python ints, each through `put32` (an
// int32 buffer's) or `put64` (the others'), which store it or set a Python error and return false. The two readers
// below differ only in what they accept.
template <typename Put32, typename Put64>
bool read_values(PyObject* obj, std::vector<int32_t>& out, Put32 put32, Put64 put64) {
    out.clear();
    Py_buffer view;
    if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        const char* fmt = view.format ? view.format : "B";
        if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
        Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
        bool ok = true, known = true;
        out.resize(static_cast<size_t>(n));
        if (view.itemsize == 4 && (*fmt == 'i' || *fmt == 'l')) {
            const int32_t* d = static_cast<const int32_t*>(view.buf);
            for (Py_ssize_t i = 0; i < n && ok; ++i) ok = put32(d[i], out[i]);
        } else if (view.itemsize == 8 && (*fmt == 'l' || *fmt == 'q')) {
            const int64_t* d = static_cast<const int64_t*>(view.buf);
            for (Py_ssize_t i = 0; i < n && ok; ++i) ok = put64(static_cast<long long>(d[i]), out[i]);
        } else {
            known = false;
        }
        PyBuffer_Release(&view);
        if (known) return ok;
        out.clear();
    } else {
        PyErr_Clear();
    }
    PyObject* seq = PySequence_Fast(obj, "token ids must be a sequence of ints");
    if (!seq) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    out.resize(static_cast<size_t>(n));
    bool ok = true;
    for (Py_ssize_t i = 0; i < n && ok; ++i) {
        if (PyBool_Check(items[i]) || !PyIndex_Check(items[i])) {  // True or 5.7 is no token id (the Python engine
            PyErr_Format(PyExc_TypeError, "token ids must be integers in [0, 2**63); got %R", items[i]);  // agrees)
            ok = false;
            break;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (v == -1 && PyErr_Occurred()) {
            ok = false;
        } else if (overflow) {
            PyErr_SetString(PyExc_ValueError, "a token id does not fit 64 bits; token ids must be integers in "
                                              "[0, 2**63)");
            ok = false;
        } else {
            ok = put64(v, out[i]);
        }
    }
    Py_DECREF(seq);
    return ok;
}

bool int32_or_error(long long v, int32_t& out) {
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "value %lld does not fit a 32-bit integer", v);
        return false;
    }
    out = static_cast<int32_t>(v);
    return true;
}

// Token values of a lane row: any 32-bit integer (-1 marks a rejected token).
bool read_tokens(PyObject* obj, std::vector<int32_t>& out) {
    return read_values(
        obj, out, [](int32_t v, int32_t& o) { return o = v, true; }, int32_or_error);
}

bool bad_id(long long v) {
    PyErr_Format(PyExc_ValueError, "token id %lld is negative; token ids must be integers in [0, 2**63)", v);
    return false;
}

bool put_id(WideIds& wide, long long v, int32_t& out) {
    if (v >= 0 && v <= INT32_MAX) {
        out = static_cast<int32_t>(v);
        return true;
    }
    if (v < 0) return bad_id(v);
    if (!wide.encode(v, out)) {
        PyErr_SetString(PyExc_OverflowError, "too many distinct token ids >= 2**31 for one suffix engine");
        return false;
    }
    return true;
}

// Token ids for start / extend: integers in [0, 2^63); ids >= 2^31 coded through `wide` (see WideIds).
bool read_ids(PyObject* obj, WideIds& wide, std::vector<int32_t>& out) {
    return read_values(
        obj,
        out,
        [](int32_t v, int32_t& o) { return v >= 0 ? (o = v, true) : bad_id(v); },
        [&wide](long long v, int32_t& o) { return put_id(wide, v, o); });
}

thread_local std::vector<int32_t> g_tokens;

PyObject* Engine_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
    static const char* kwlist[] = {"depth", "max_cached_requests", "max_cached_tokens", nullptr};
    int depth = 24;
    long long mr = 10000, mt = 100000000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|iLL", const_cast<char**>(kwlist), &depth, &mr, &mt))
        return nullptr;
    if (depth < 2 || depth > 4096) {
        PyErr_SetString(PyExc_ValueError, "depth must be in [2, 4096]");
        return nullptr;
    }
    PyEngine* self = reinterpret_cast<PyEngine*>(type->tp_alloc(type, 0));
    if (!self) return nullptr;
    self->engine = new Engine(depth, mr, mt);
    return reinterpret_cast<PyObject*>(self);
}

void Engine_dealloc(PyEngine* self) {
    delete self->engine;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* Engine_start(PyEngine* self, PyObject* args) {
    long long rid;
    PyObject* toks;
    if (!PyArg_ParseTuple(args, "LO", &rid, &toks)) return nullptr;
    Engine& e = *self->engine;
    quiesce(e);
    if (!read_ids(toks, e.wide, g_tokens)) return nullptr;
    e.start(rid, g_tokens.data(), g_tokens.size());
    Py_RETURN_NONE;
}

PyObject* Engine_extend(PyEngine* self, PyObject* args) {
    long long rid;
    PyObject* toks;
    if (!PyArg_ParseTuple(args, "LO", &rid, &toks)) return nullptr;
    quiesce(*self->engine);
    auto it = self->engine->requests.find(rid);
    if (it == self->engine->requests.end()) {
        PyErr_Format(PyExc_KeyError, "request %lld is not active (call start first)", rid);
        return nullptr;
    }
    if (!read_ids(toks, self->engine->wide, g_tokens)) return nullptr;
    self->engine->extend_learning(it->second, g_tokens.data(), g_tokens.size());
    Py_RETURN_NONE;
}

PyObject* Engine_stop(PyEngine* self, PyObject* args) {
    long long rid;
    if (!PyArg_ParseTuple(args, "L", &rid)) return nullptr;
    quiesce(*self->engine);
    self->engine->stop(rid);
    Py_RETURN_NONE;
}

PyObject* Engine_cache(PyEngine* self, PyObject* args) {
    PyObject* toks;
    if (!PyArg_ParseTuple(args, "O", &toks)) return nullptr;
    Engine& e = *self->engine;
    quiesce(e);
    if (!read_ids(toks, e.wide, g_tokens)) return nullptr;
    e.cache(std::vector<int32_t>(g_tokens.begin(), g_tokens.end()));
    Py_RETURN_NONE;
}

PyObject* int_list(const std::vector<int32_t>& v) {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.size()));
    if (!list) return nullptr;
    for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(list, i, PyLong_FromLong(v[i]));
    return list;
}

PyObject* id_list(const std::vector<int32_t>& v, const WideIds& wide) {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.size()));
    if (!list) return nullptr;
    for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(list, i, PyLong_FromLongLong(wide.decode(v[i])));
    return list;
}

// draft(rid, budget, tree, factor, offset, min_prob, use_local, use_global, leaf_prior=0, calibrated=False)
//   -> (tokens, parents, probs, score, match_len, source)
PyObject* Engine_draft(PyEngine* self, PyObject* args) {
    long long rid;
    DraftParams p;
    int tree, use_local, use_global, calibrated = 0;
    if (!PyArg_ParseTuple(args, "Lipdddpp|dp", &rid, &p.budget, &tree, &p.factor, &p.offset, &p.min_prob, &use_local,
                          &use_global, &p.leaf_prior, &calibrated))
        return nullptr;
    p.tree = tree != 0;
    if (calibrated && !p.tree) p.calib = &self->engine->calib;  // trees keep count / total
    quiesce(*self->engine);
    auto it = self->engine->requests.find(rid);
    if (it == self->engine->requests.end()) {
        PyErr_Format(PyExc_KeyError, "request %lld is not active (call start first)", rid);
        return nullptr;
    }
    const Draft& d = self->engine->draft(it->second, p, use_local != 0, use_global != 0);
    PyObject* probs = PyList_New(static_cast<Py_ssize_t>(d.probs.size()));
    if (!probs) return nullptr;
    for (size_t i = 0; i < d.probs.size(); ++i) PyList_SET_ITEM(probs, i, PyFloat_FromDouble(d.probs[i]));
    return Py_BuildValue("(NNNdii)", id_list(d.tokens, self->engine->wide), int_list(d.parents), probs, d.score,
                         d.match_len, d.source);
}

PyObject* Engine_memory_bytes(PyEngine* self, PyObject*) {
    quiesce(*self->engine);
    return PyLong_FromSize_t(self->engine->memory_bytes());
}

PyObject* Engine_global_stats(PyEngine* self, PyObject*) {
    quiesce(*self->engine);
    Engine* e = self->engine;
    return Py_BuildValue("{s:n,s:n,s:L,s:n}", "nodes", static_cast<Py_ssize_t>(e->global.live_nodes()),
                         "bytes", static_cast<Py_ssize_t>(e->global.memory_bytes()), "cached_tokens",
                         static_cast<long long>(e->cached_tokens), "cached_requests",
                         static_cast<Py_ssize_t>(e->cached.size()));
}

PyObject* Engine_local_nodes(PyEngine* self, PyObject* args) {
    long long rid;
    if (!PyArg_ParseTuple(args, "L", &rid)) return nullptr;
    quiesce(*self->engine);
    auto it = self->engine->requests.find(rid);
    if (it == self->engine->requests.end()) return PyLong_FromLong(0);
    return PyLong_FromSize_t(it->second.local->live_nodes());
}

#include "suffix_lane.inc"
#include "suffix_lane_tokens.inc"
#include "suffix_lane_async.inc"

PyMethodDef Engine_methods[] = {
    {"start", reinterpret_cast<PyCFunction>(Engine_start), METH_VARARGS, "start(rid, prompt_ids)"},
    {"extend", reinterpret_cast<PyCFunction>(Engine_extend), METH_VARARGS,
     "extend(rid, token_ids): append them, the calibration learning from each"},
    {"stop", reinterpret_cast<PyCFunction>(Engine_stop), METH_VARARGS, "stop(rid): cache the response"},
    {"cache", reinterpret_cast<PyCFunction>(Engine_cache), METH_VARARGS,
     "cache(token_ids): add a finished response from elsewhere to the global trie"},
    {"draft", reinterpret_cast<PyCFunction>(Engine_draft), METH_VARARGS,
     "draft(rid, budget, tree, factor, offset, min_prob, use_local, use_global, leaf_prior=0, calibrated=False)"},
    {"memory_bytes", reinterpret_cast<PyCFunction>(Engine_memory_bytes), METH_NOARGS, "bytes held"},
    {"global_stats", reinterpret_cast<PyCFunction>(Engine_global_stats), METH_NOARGS, "global trie stats"},
    {"local_nodes", reinterpret_cast<PyCFunction>(Engine_local_nodes), METH_VARARGS, "nodes of a request trie"},
    {"lane_config", reinterpret_cast<PyCFunction>(Engine_lane_config), METH_VARARGS, kLaneConfigDoc},
    {"lane_mark", reinterpret_cast<PyCFunction>(Engine_lane_mark), METH_VARARGS, "lane_mark(rid, n_known, fresh=True): the request's book knows n_known tokens; fresh: its next row carries "
     "exactly n_known (no extend), else it extends n_known by the row's sampled tokens"},
    {"lane_forget", reinterpret_cast<PyCFunction>(Engine_lane_forget), METH_VARARGS,
     "lane_forget(rids): these requests' drafts of the last step were withheld (their books forget them)"},
    {"lane_step", reinterpret_cast<PyCFunction>(Engine_lane_step), METH_VARARGS, kLaneStepDoc},
    {"lane_step_tokens", reinterpret_cast<PyCFunction>(Engine_lane_step_tokens), METH_VARARGS, kLaneStepTokensDoc},
    {"lane_submit", reinterpret_cast<PyCFunction>(Engine_lane_submit), METH_VARARGS, kLaneSubmitDoc},
    {"lane_collect", reinterpret_cast<PyCFunction>(Engine_lane_collect), METH_VARARGS, kLaneCollectDoc},
    {"lane_spin", reinterpret_cast<PyCFunction>(Engine_lane_spin), METH_VARARGS, kLaneSpinDoc},
    {"lane_threads", reinterpret_cast<PyCFunction>(Engine_lane_threads), METH_VARARGS, kLaneThreadsDoc},
    {"lane_prepare", reinterpret_cast<PyCFunction>(Engine_lane_prepare), METH_VARARGS, kLanePrepareDoc},
    {"lane_refresh", reinterpret_cast<PyCFunction>(Engine_lane_refresh), METH_NOARGS, kLaneRefreshDoc},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject EngineType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_suffix_native", "Native suffix-trie drafter core", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__suffix_native(void) {
    EngineType.tp_name = "specdec.drafters._suffix_native.Engine";
    EngineType.tp_basicsize = sizeof(PyEngine);
    EngineType.tp_flags = Py_TPFLAGS_DEFAULT;
    EngineType.tp_new = Engine_new;
    EngineType.tp_dealloc = reinterpret_cast<destructor>(Engine_dealloc);
    EngineType.tp_methods = Engine_methods;
    EngineType.tp_doc = "Engine(depth, max_cached_requests, max_cached_tokens)";
    if (PyType_Ready(&EngineType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (!m) return nullptr;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", reinterpret_cast<PyObject*>(&EngineType)) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
