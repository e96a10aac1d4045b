-- Which file a model's path led to at registration (st_dev, st_ino of the file, links
-- followed): a file swapped in at the same path with the same size and mtime (a symlink
-- re-pointed) is then seen as changed. NULL for models registered before.

ALTER TABLE models ADD COLUMN device INTEGER;
ALTER TABLE models ADD COLUMN inode INTEGER;
