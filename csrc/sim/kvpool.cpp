// scheduling._kvpool: the replay engine's paged KV block pool (vLLM V1 semantics), compiled.
//
// Same behaviour, block for block, as the pure-Python reference scheduling.kv_cache.PyBlockPool
// (a differential test drives both with the same random operations). Why compiled: every turn of
// every agent touches, frees and re-hashes its whole context (thousands of blocks), and a replay
// under overload recomputes tens of millions of tokens; in Python those per-block loops were
// most of a sweep's time.
//
// Blocks are ints 0..N-1; block 0 is the null block (never handed out). The free queue is an
// intrusive doubly linked list over two int arrays with head/tail sentinels at N and N+1:
// popped from the head (least recently freed), appended at the tail. A freed block keeps its
// hash (a prefix-cache hit) until it is popped for reuse; every such eviction is logged in order.
// As vLLM's block pool, the hash map does not de-duplicate: a block computed again under a hash
// another block holds is indexed as a later copy; a lookup returns the oldest surviving copy, and a
// hash leaves the map only with its last copy (scheduling/kv_cache.py says when copies arise).
// Lists passed in and returned are Python lists of ints (the engine's Request.blocks).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// Item i of a list of block hashes (Python ints that fit in 64 bits: hash() of a tuple).
int64_t hash_at(const py::list& hashes, Py_ssize_t i) {
  long long v = PyLong_AsLongLong(PyList_GET_ITEM(hashes.ptr(), i));
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Open-addressing map int64 -> int32 (linear probing, backward-shift deletion, power-of-two size).
// Why not std::unordered_map: one node allocation per insert and a free per erase; a replay under
// overload caches and evicts millions of block hashes.
class FlatMap {
 public:
  explicit FlatMap(size_t expected = 16) { rehash(capacity_for(expected)); }

  size_t size() const { return size_; }

  // Insert if absent; true when inserted.
  bool emplace(int64_t key, int32_t value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) rehash(slots_.size() * 2);
    size_t i = home(key);
    while (used_[i]) {
      if (slots_[i].key == key) return false;
      i = (i + 1) & mask_;
    }
    used_[i] = 1;
    slots_[i] = {key, value};
    ++size_;
    return true;
  }

  const int32_t* find(int64_t key) const {
    size_t i = home(key);
    while (used_[i]) {
      if (slots_[i].key == key) return &slots_[i].value;
      i = (i + 1) & mask_;
    }
    return nullptr;
  }
  int32_t* find(int64_t key) { return const_cast<int32_t*>(static_cast<const FlatMap*>(this)->find(key)); }

  bool erase(int64_t key) {
    size_t i = home(key);
    while (used_[i]) {
      if (slots_[i].key == key) {
        // Backward shift: pull later members of the probe run into the hole, so lookups never
        // need tombstones.
        size_t hole = i;
        size_t j = (i + 1) & mask_;
        while (used_[j]) {
          size_t h = home(slots_[j].key);
          if (((j - h) & mask_) >= ((j - hole) & mask_)) {
            slots_[hole] = slots_[j];
            hole = j;
          }
          j = (j + 1) & mask_;
        }
        used_[hole] = 0;
        --size_;
        return true;
      }
      i = (i + 1) & mask_;
    }
    return false;
  }

  template <class F>
  void for_each(F f) const {
    for (size_t i = 0; i < slots_.size(); ++i)
      if (used_[i]) f(slots_[i].key, slots_[i].value);
  }

 private:
  struct Slot {
    int64_t key;
    int32_t value;
  };
  static size_t capacity_for(size_t n) {
    size_t c = 16;
    while (c * 3 < n * 4 + 4) c <<= 1;
    return c;
  }
  size_t home(int64_t key) const {
    uint64_t x = static_cast<uint64_t>(key);  // splitmix64 finalizer: spread any key over the table
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return static_cast<size_t>(x) & mask_;
  }
  void rehash(size_t cap) {
    std::vector<Slot> old_slots;
    std::vector<char> old_used;
    old_slots.swap(slots_);
    old_used.swap(used_);
    slots_.assign(cap, Slot{0, 0});
    used_.assign(cap, 0);
    mask_ = cap - 1;
    size_ = 0;
    for (size_t i = 0; i < old_slots.size(); ++i)
      if (old_used[i]) emplace(old_slots[i].key, old_slots[i].value);
  }

  std::vector<Slot> slots_;
  std::vector<char> used_;
  size_t mask_ = 0, size_ = 0;
};

class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks) {
    if (num_blocks < 2)
      throw std::invalid_argument("a block pool needs at least 2 blocks (null + 1), got " +
                                  std::to_string(num_blocks));
    n_ = static_cast<int32_t>(num_blocks);
    head_ = n_;
    tail_ = n_ + 1;
    ref_.assign(n_, 0);
    has_hash_.assign(n_, 0);
    hash_.assign(n_, 0);
    prev_.assign(n_ + 2, -1);
    next_.assign(n_ + 2, -1);
    ref_[0] = 1;  // the null block: never freed, never handed out
    int32_t p = head_;
    for (int32_t b = 1; b < n_; ++b) {
      next_[p] = b;
      prev_[b] = p;
      p = b;
    }
    next_[p] = tail_;
    prev_[tail_] = p;
    num_free_ = n_ - 1;
    cached_ = FlatMap(static_cast<size_t>(n_));
  }

  int64_t num_total_blocks() const { return n_ - 1; }
  int64_t num_free_blocks() const { return num_free_; }
  int64_t num_used_blocks() const { return n_ - 1 - num_free_; }
  int64_t num_cached_free() const { return num_cached_free_; }
  int64_t num_evictions() const { return static_cast<int64_t>(evicted_.size()); }

  // Pop k blocks (evicting their hashes), ref count 1; None when fewer than k are free.
  py::object get_new_blocks(int64_t k) {
    if (k < 0) throw std::invalid_argument("negative block count");
    if (k > num_free_) return py::none();
    PyObject* out = PyList_New(k);
    if (!out) throw py::error_already_set();
    int32_t b = next_[head_];
    for (int64_t i = 0; i < k; ++i) {
      int32_t nxt = next_[b];
      prev_[b] = next_[b] = -1;
      if (has_hash_[b]) {
        --num_cached_free_;
        uncache(b, hash_[b]);
        has_hash_[b] = 0;
        evicted_.push_back(hash_[b]);
      }
      ref_[b] = 1;
      PyList_SET_ITEM(out, i, PyLong_FromLong(b));
      b = nxt;
    }
    next_[head_] = b;
    prev_[b] = head_;
    num_free_ -= k;
    return py::reinterpret_steal<py::object>(out);
  }

  // Take a reference on each block (prefix hits), pulling free ones off the free queue.
  void touch(const py::list& blocks) {
    const Py_ssize_t n = PyList_GET_SIZE(blocks.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
      int32_t b = id_at(blocks, i);
      if (ref_[b] == 0) {
        int32_t p = prev_[b], nx = next_[b];
        if (p < 0 || nx < 0) throw std::runtime_error("touch of block " + std::to_string(b) +
                                                      ": ref count 0 but not in the free queue");
        next_[p] = nx;
        prev_[nx] = p;
        prev_[b] = next_[b] = -1;
        --num_free_;
        if (has_hash_[b]) --num_cached_free_;
      }
      ++ref_[b];
    }
  }

  // Drop one reference per block; blocks reaching 0 join the free queue in list order
  // (reverse=true: from the last block to the first, so a request's tail is evicted first).
  // As vLLM's BlockPool.free_blocks: a block reaching ref count 0 with a hash joins the tail (evicted
  // last: it may still be hit); one without a hash is worth nothing and goes to the head (evicted
  // first), the hash-less blocks of one call keeping their order there.
  void free_blocks(const py::list& blocks, bool reverse) {
    const Py_ssize_t n = PyList_GET_SIZE(blocks.ptr());
    uncached_.clear();
    for (Py_ssize_t j = 0; j < n; ++j) {
      int32_t b = id_at(blocks, reverse ? n - 1 - j : j);
      if (ref_[b] <= 0 || b == 0)
        throw std::runtime_error("free of block " + std::to_string(b) + " with ref count " +
                                 std::to_string(ref_[b]));
      if (--ref_[b] == 0) {
        ++num_free_;
        if (!has_hash_[b]) {
          uncached_.push_back(b);
          continue;
        }
        ++num_cached_free_;
        int32_t last = prev_[tail_];
        next_[last] = b;
        prev_[b] = last;
        next_[b] = tail_;
        prev_[tail_] = b;
      }
    }
    for (auto it = uncached_.rbegin(); it != uncached_.rend(); ++it) {
      int32_t b = *it, first = next_[head_];
      next_[head_] = b;
      prev_[b] = head_;
      next_[b] = first;
      prev_[first] = b;
    }
  }

  // How many of the blocks have ref count 0 (touching them would take them off the free queue).
  int64_t count_free(const py::list& blocks) const {
    const Py_ssize_t n = PyList_GET_SIZE(blocks.ptr());
    int64_t c = 0;
    for (Py_ssize_t i = 0; i < n; ++i) c += ref_[id_at(blocks, i)] == 0;
    return c;
  }

  // Give blocks[k] the hash hashes[k] for k in [start, stop), unless the block already has one; a
  // hash another block holds makes this block a later copy (lookups keep returning the oldest).
  void cache_blocks(const py::list& blocks, const py::list& hashes, int64_t start, int64_t stop) {
    if (start < 0 || stop > PyList_GET_SIZE(blocks.ptr()) || stop > PyList_GET_SIZE(hashes.ptr()))
      throw std::out_of_range("cache_blocks range outside the lists");
    for (int64_t k = start; k < stop; ++k) {
      int32_t b = id_at(blocks, k);
      if (!has_hash_[b]) index_block(b, hash_at(hashes, k));
    }
  }

  void cache_block(int64_t b, int64_t h) {
    check_id(b);
    if (!has_hash_[b]) index_block(static_cast<int32_t>(b), h);
  }

  // Every block holding h, oldest first (for tests and invariant checks).
  py::list cached_copies(int64_t h) const {
    py::list out;
    const int32_t* first = cached_.find(h);
    if (first == nullptr) return out;
    out.append(*first);
    auto later = copies_.find(h);
    if (later != copies_.end())
      for (int32_t b : later->second) out.append(b);
    return out;
  }

  // Cached blocks for hashes[start:stop], in order, up to the first miss.
  py::list lookup(const py::list& hashes, int64_t start, int64_t stop) const {
    if (start < 0) throw std::out_of_range("negative start");
    if (stop > PyList_GET_SIZE(hashes.ptr())) stop = PyList_GET_SIZE(hashes.ptr());
    py::list out;
    for (int64_t k = start; k < stop; ++k) {
      const int32_t* b = cached_.find(hash_at(hashes, k));
      if (b == nullptr) break;
      PyObject* v = PyLong_FromLong(*b);
      if (!v || PyList_Append(out.ptr(), v) != 0) {
        Py_XDECREF(v);
        throw py::error_already_set();
      }
      Py_DECREF(v);
    }
    return out;
  }

  py::object get_cached_block(int64_t h) const {
    const int32_t* b = cached_.find(h);
    if (b == nullptr) return py::none();
    return py::int_(*b);
  }

  // Hashes evicted since position pos of the eviction log, in order.
  py::list evicted_since(int64_t pos) const {
    py::list out;
    for (size_t i = pos < 0 ? 0 : static_cast<size_t>(pos); i < evicted_.size(); ++i) out.append(evicted_[i]);
    return out;
  }

  int64_t ref_cnt(int64_t b) const { check_id(b); return ref_[b]; }
  py::object block_hash(int64_t b) const {
    check_id(b);
    return has_hash_[b] ? py::object(py::int_(hash_[b])) : py::none();
  }

  py::list free_queue_ids() const {
    py::list out;
    for (int32_t b = next_[head_]; b != tail_; b = next_[b]) out.append(b);
    return out;
  }

  void check_invariants() const {
    std::vector<char> in_queue(n_, 0);
    int64_t count = 0, cached_free = 0;
    for (int32_t b = next_[head_]; b != tail_; b = next_[b]) {
      if (b <= 0 || b >= n_ || in_queue[b]) throw std::runtime_error("free queue corrupt at block " + std::to_string(b));
      in_queue[b] = 1;
      ++count;
      cached_free += has_hash_[b];
    }
    if (count != num_free_) throw std::runtime_error("free count " + std::to_string(num_free_) + " but " +
                                                     std::to_string(count) + " blocks in the queue");
    if (cached_free != num_cached_free_) throw std::runtime_error("cached-free count is off");
    for (int32_t b = 1; b < n_; ++b)
      if (ref_[b] < 0 || (ref_[b] == 0) != static_cast<bool>(in_queue[b]))
        throw std::runtime_error("block " + std::to_string(b) + ": ref count and free queue disagree");
    size_t hashed = 0, indexed = cached_.size();
    for (int32_t b = 1; b < n_; ++b) hashed += has_hash_[b] != 0;
    for (const auto& [h, later] : copies_) {
      if (later.empty() || cached_.find(h) == nullptr)
        throw std::runtime_error("hash map corrupt: copies of an uncached hash");
      for (int32_t b : later)
        if (b <= 0 || b >= n_ || !has_hash_[b] || hash_[b] != h) throw std::runtime_error("hash map corrupt: a copy");
      indexed += later.size();
    }
    if (hashed != indexed) throw std::runtime_error("hash map corrupt: a hashed block is not indexed");
    cached_.for_each([this](int64_t h, int32_t b) {
      if (b <= 0 || b >= n_ || !has_hash_[b] || hash_[b] != h) throw std::runtime_error("hash map corrupt");
    });
  }

 private:
  int32_t id_at(const py::list& blocks, Py_ssize_t i) const {
    long v = PyLong_AsLong(PyList_GET_ITEM(blocks.ptr(), i));
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v < 0 || v >= n_) throw std::out_of_range("block id " + std::to_string(v) + " outside the pool");
    return static_cast<int32_t>(v);
  }
  void check_id(int64_t b) const {
    if (b < 0 || b >= n_) throw std::out_of_range("block id " + std::to_string(b) + " outside the pool");
  }

  // Give block b (hash-less) the hash h: the hash's first block, or a later copy of it.
  void index_block(int32_t b, int64_t h) {
    has_hash_[b] = 1;
    hash_[b] = h;
    if (!cached_.emplace(h, b)) copies_[h].push_back(b);
  }

  // Take block b out of the map under its hash h; the oldest later copy, if any, takes its place.
  void uncache(int32_t b, int64_t h) {
    auto later = copies_.empty() ? copies_.end() : copies_.find(h);
    int32_t* first = cached_.find(h);
    if (*first == b) {
      if (later == copies_.end()) {
        cached_.erase(h);
        return;
      }
      *first = later->second.front();
      later->second.erase(later->second.begin());
    } else {
      auto& v = later->second;  // b is a later copy
      v.erase(std::find(v.begin(), v.end(), b));
    }
    if (later->second.empty()) copies_.erase(later);
  }

  int32_t n_, head_, tail_;
  std::vector<int32_t> ref_, prev_, next_;
  std::vector<int32_t> uncached_;  // scratch of free_blocks (kept to avoid an allocation per call)
  std::vector<char> has_hash_;
  std::vector<int64_t> hash_;
  FlatMap cached_;  // hash -> its oldest surviving copy
  // hash -> later copies in the order they were cached; only hashes held by two or more blocks (rare).
  std::unordered_map<int64_t, std::vector<int32_t>> copies_;
  std::vector<int64_t> evicted_;
  int64_t num_free_ = 0, num_cached_free_ = 0;
};

// An LRU set of block hashes with a fixed capacity: the cpu-offload policy's host pool.
// Same results as the dict-based reference in scheduling/policies/cpu_offload.py (tested).
class HashLRU {
 public:
  explicit HashLRU(int64_t capacity) : cap_(capacity), map_(capacity > 0 ? static_cast<size_t>(capacity) : 16) {
    if (capacity < 0) throw std::invalid_argument("negative capacity");
    const size_t slots = static_cast<size_t>(capacity) + 2;
    key_.assign(slots, 0);
    prev_.assign(slots, -1);
    next_.assign(slots, -1);
    head_ = static_cast<int32_t>(capacity);
    tail_ = head_ + 1;
    next_[head_] = tail_;
    prev_[tail_] = head_;
    for (int32_t i = head_ - 1; i >= 0; --i) free_.push_back(i);
  }

  int64_t size() const { return static_cast<int64_t>(map_.size()); }
  int64_t capacity() const { return cap_; }
  bool contains(int64_t h) const { return map_.find(h) != nullptr; }

  // For each hash in order: refresh it to the MRU end if held, else insert it there and evict
  // the LRU entry while over capacity. Returns how many were not held when the call began (a
  // held hash that is evicted by this call's own inserts before its turn, then re-inserted, is
  // not new: the counters are net). The hashes of one call are distinct (one job's chain).
  int64_t store(const py::list& hashes, int64_t n) {
    if (n > PyList_GET_SIZE(hashes.ptr())) throw std::out_of_range("store past the end of the list");
    int64_t num_new = n;
    for (int64_t k = 0; k < n; ++k) num_new -= map_.find(hash_at(hashes, k)) != nullptr;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t h = hash_at(hashes, k);
      const int32_t* slot = map_.find(h);
      if (slot != nullptr) {
        move_to_end(*slot);
        continue;
      }
      if (cap_ == 0) continue;
      if (static_cast<int64_t>(map_.size()) >= cap_) evict_lru();
      const int32_t s = free_.back();
      free_.pop_back();
      key_[s] = h;
      link_at_end(s);
      map_.emplace(h, s);
    }
    return num_new;
  }

  // How many of hashes[first:last] are held, counting from first up to the first miss.
  int64_t count_prefix(const py::list& hashes, int64_t first, int64_t last) const {
    if (first < 0) throw std::out_of_range("negative start");
    if (last > PyList_GET_SIZE(hashes.ptr())) last = PyList_GET_SIZE(hashes.ptr());
    int64_t n = 0;
    for (int64_t k = first; k < last && map_.find(hash_at(hashes, k)) != nullptr; ++k) ++n;
    return n;
  }

  // Move hashes[first:first+n] (all held) to the MRU end, in order.
  void refresh(const py::list& hashes, int64_t first, int64_t n) {
    if (first < 0 || first + n > PyList_GET_SIZE(hashes.ptr())) throw std::out_of_range("refresh range");
    for (int64_t k = first; k < first + n; ++k) {
      const int32_t* slot = map_.find(hash_at(hashes, k));
      if (slot == nullptr) throw std::runtime_error("refresh of a hash the pool does not hold");
      move_to_end(*slot);
    }
  }

  py::list keys() const {  // LRU first
    py::list out;
    for (int32_t s = next_[head_]; s != tail_; s = next_[s]) out.append(key_[s]);
    return out;
  }

 private:
  void unlink(int32_t s) {
    next_[prev_[s]] = next_[s];
    prev_[next_[s]] = prev_[s];
  }
  void link_at_end(int32_t s) {
    const int32_t last = prev_[tail_];
    next_[last] = s;
    prev_[s] = last;
    next_[s] = tail_;
    prev_[tail_] = s;
  }
  void move_to_end(int32_t s) {
    if (next_[s] == tail_) return;
    unlink(s);
    link_at_end(s);
  }
  void evict_lru() {
    const int32_t s = next_[head_];
    unlink(s);
    map_.erase(key_[s]);
    free_.push_back(s);
  }

  int64_t cap_;
  FlatMap map_;
  std::vector<int64_t> key_;
  std::vector<int32_t> prev_, next_, free_;
  int32_t head_, tail_;
};

}  // namespace

PYBIND11_MODULE(_kvpool, m) {
  m.doc() = "Compiled paged-KV block pool for the replay engine (see scheduling/kv_cache.py).";
  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def_property_readonly("num_total_blocks", &BlockPool::num_total_blocks)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def_property_readonly("num_used_blocks", &BlockPool::num_used_blocks)
      .def_property_readonly("num_cached_free", &BlockPool::num_cached_free)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def("get_new_blocks", &BlockPool::get_new_blocks)
      .def("touch", &BlockPool::touch)
      .def("free_blocks", &BlockPool::free_blocks, py::arg("blocks"), py::arg("reverse") = false)
      .def("count_free", &BlockPool::count_free)
      .def("cache_blocks", &BlockPool::cache_blocks)
      .def("cache_block", &BlockPool::cache_block)
      .def("lookup", &BlockPool::lookup)
      .def("get_cached_block", &BlockPool::get_cached_block)
      .def("cached_copies", &BlockPool::cached_copies)
      .def("evicted_since", &BlockPool::evicted_since)
      .def("ref_cnt", &BlockPool::ref_cnt)
      .def("block_hash", &BlockPool::block_hash)
      .def("free_queue_ids", &BlockPool::free_queue_ids)
      .def("check_invariants", &BlockPool::check_invariants);
  py::class_<HashLRU>(m, "HashLRU")
      .def(py::init<int64_t>(), py::arg("capacity"))
      .def("__len__", &HashLRU::size)
      .def("__contains__", &HashLRU::contains)
      .def_property_readonly("capacity", &HashLRU::capacity)
      .def("store", &HashLRU::store)
      .def("count_prefix", &HashLRU::count_prefix)
      .def("refresh", &HashLRU::refresh)
      .def("keys", &HashLRU::keys);
}
